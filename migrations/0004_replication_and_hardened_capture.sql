-- CHANGE_FEED=replication reads the changes to `posts` from this
-- publication through one logical replication slot per fleet (made by the
-- service itself). Creating it needs no wal_level = logical (the server only
-- warns), so the same migrations serve both modes. Only the id is published
-- (a column list): the walsender then converts and sends one column per row
-- changed, not the whole post.
do $$
begin
    if not exists (select 1 from pg_publication where pubname = 'postcache_posts') then
        create publication postcache_posts for table posts (id);
    end if;
end
$$;

-- CHANGE_FEED=trigger, hardened: no writer can forge, hide or break it.
--
-- - The capture functions run with their owner's rights (`security
--   definer`) and a fixed search_path, naming the outbox by its schema: a
--   writer needs no privilege on `post_changes`, and none is granted.
-- - `xid` and `changed_at` are set by the outbox's own trigger, whatever an
--   insert says: a row cannot claim another transaction or another time.
-- - There is no session switch any more (`postcache.capture` is ignored):
--   capture is off only for a session that may set
--   `session_replication_role = replica`, a superuser's right, which
--   `postcache seed` uses for its batches (with one `invalidate_all` each).
do $do$
declare
    s text := current_schema();
begin
    execute format($f$
        create or replace function %1$I.posts_capture_insert() returns trigger
        language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
        begin
            insert into %1$I.post_changes (post_id, op) select id, 'insert' from new_rows;
            return null;
        end
        $$ $f$, s);
    execute format($f$
        create or replace function %1$I.posts_capture_update() returns trigger
        language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
        begin
            -- A row whose id changed is a delete of the old id and an insert of the new.
            insert into %1$I.post_changes (post_id, op)
            select coalesce(n.id, o.id),
                   case when n.id is null then 'delete' when o.id is null then 'insert' else 'update' end
            from new_rows n full join old_rows o on n.id = o.id
            where n is distinct from o;
            return null;
        end
        $$ $f$, s);
    execute format($f$
        create or replace function %1$I.posts_capture_delete() returns trigger
        language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
        begin
            insert into %1$I.post_changes (post_id, op) select id, 'delete' from old_rows;
            return null;
        end
        $$ $f$, s);
    execute format($f$
        create or replace function %1$I.posts_capture_truncate() returns trigger
        language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
        begin
            insert into %1$I.post_changes (post_id, op) values (null, 'truncate');
            return null;
        end
        $$ $f$, s);
    execute format($f$
        create or replace function %1$I.post_changes_stamp() returns trigger
        language plpgsql set search_path = pg_catalog, pg_temp as $$
        begin
            new.xid := pg_current_xact_id();
            new.changed_at := clock_timestamp();
            return new;
        end
        $$ $f$, s);
    execute format($f$
        create or replace function %1$I.post_changes_notify() returns trigger
        language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
        begin
            if exists (select 1 from added) then
                perform pg_notify('postcache_changes', '');
            end if;
            return null;
        end
        $$ $f$, s);
end
$do$;

create or replace trigger post_changes_stamp
    before insert or update on post_changes
    for each row execute function post_changes_stamp();

revoke all on post_changes from public;
revoke all on function posts_capture_insert(), posts_capture_update(),
    posts_capture_delete(), posts_capture_truncate(), post_changes_stamp(),
    post_changes_notify() from public;
