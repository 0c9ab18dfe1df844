-- Bulk writes that invalidate as a whole: a transaction that sets
-- `postcache.capture` to `off` (`set local postcache.capture = off`) writes
-- no outbox row per post changed; it records one change for every post
-- itself (op `invalidate_all`), in the same transaction. `postcache seed`
-- does so per batch: 10 million posts make a thousand changes, not ten
-- million for every instance to apply. Any other writer is captured as before.
create or replace function posts_capture_insert() returns trigger
language plpgsql as $$
begin
    if current_setting('postcache.capture', true) = 'off' then
        return null;
    end if;
    insert into post_changes (post_id, op) select id, 'insert' from new_rows;
    return null;
end
$$;

create or replace function posts_capture_update() returns trigger
language plpgsql as $$
begin
    if current_setting('postcache.capture', true) = 'off' then
        return null;
    end if;
    -- A row whose id changed is a delete of the old id and an insert of the new.
    insert into post_changes (post_id, op)
    select coalesce(n.id, o.id),
           case when n.id is null then 'delete' when o.id is null then 'insert' else 'update' end
    from new_rows n full join old_rows o on n.id = o.id
    where n is distinct from o;
    return null;
end
$$;

create or replace function posts_capture_delete() returns trigger
language plpgsql as $$
begin
    if current_setting('postcache.capture', true) = 'off' then
        return null;
    end if;
    insert into post_changes (post_id, op) select id, 'delete' from old_rows;
    return null;
end
$$;
