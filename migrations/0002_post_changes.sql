-- The change feed's outbox: every change to `posts`, whoever writes it, is
-- appended here by a trigger in the writer's own transaction, and announced
-- on the channel `postcache_changes` when it commits.
--
-- `xid` is the writing transaction: the instances catch up by snapshot
-- (every row of a transaction that was still running, or not yet started,
-- at their last look), never by id alone, because ids are handed out before
-- commit and so can commit out of order.
create table if not exists post_changes (
    id bigint generated always as identity primary key,
    -- null for a change to every post (truncate, invalidate --all)
    post_id bigint,
    op text not null
        constraint post_changes_op check (op in
            ('insert', 'update', 'delete', 'truncate', 'invalidate', 'invalidate_all')),
    xid xid8 not null default pg_current_xact_id(),
    changed_at timestamptz not null default clock_timestamp()
);

create index if not exists post_changes_xid on post_changes (xid);
create index if not exists post_changes_changed_at on post_changes (changed_at);

-- One notification per statement that wrote changes (not per row): the
-- instances read the rows themselves. Its payload is empty.
create or replace function post_changes_notify() returns trigger
language plpgsql as $$
begin
    if exists (select 1 from added) then
        perform pg_notify('postcache_changes', '');
    end if;
    return null;
end
$$;

create or replace trigger post_changes_notify
    after insert on post_changes referencing new table as added
    for each statement execute function post_changes_notify();

-- Statement-level, with transition tables: a bulk statement appends its
-- rows in one insert. Updates that change nothing are not changes.
create or replace function posts_capture_insert() returns trigger
language plpgsql as $$
begin
    insert into post_changes (post_id, op) select id, 'insert' from new_rows;
    return null;
end
$$;

create or replace function posts_capture_update() returns trigger
language plpgsql as $$
begin
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
    insert into post_changes (post_id, op) select id, 'delete' from old_rows;
    return null;
end
$$;

create or replace function posts_capture_truncate() returns trigger
language plpgsql as $$
begin
    insert into post_changes (post_id, op) values (null, 'truncate');
    return null;
end
$$;

create or replace trigger posts_capture_insert
    after insert on posts referencing new table as new_rows
    for each statement execute function posts_capture_insert();

create or replace trigger posts_capture_update
    after update on posts referencing old table as old_rows new table as new_rows
    for each statement execute function posts_capture_update();

create or replace trigger posts_capture_delete
    after delete on posts referencing old table as old_rows
    for each statement execute function posts_capture_delete();

create or replace trigger posts_capture_truncate
    after truncate on posts
    for each statement execute function posts_capture_truncate();
