-- Loads from read replicas (DATABASE_REPLICA_URLS): the posts asked for,
-- with the WAL position the server had replayed before it read them.
--
-- The first row carries only that position (`replay_lsn`, bytes from 0/0;
-- post columns null); then one row per post found. On a standby it is
-- pg_last_wal_replay_lsn(); on a server not in recovery (a primary, or a
-- standby since promoted) every commit is visible and it is the WAL insert
-- position, so that it never goes backwards for a server we read.
--
-- Why a function: within one plain statement the snapshot is taken before
-- any function in it runs, so a replay position read in the same statement
-- may already include a commit the rows' snapshot does not. A volatile
-- function takes a new snapshot for each statement it runs (READ
-- COMMITTED): the position is read first, the rows after, so every commit
-- up to the position is visible in the rows. Still one round trip.
create or replace function postcache_read_posts(ids bigint[])
returns table (
    replay_lsn bigint,
    post_id bigint,
    post_title text,
    post_body text,
    post_author text,
    post_created_at timestamptz,
    post_updated_at timestamptz
)
language plpgsql volatile as $$
declare
    replayed bigint;
begin
    replayed := (case when pg_is_in_recovery()
                      then coalesce(pg_last_wal_replay_lsn(), '0/0'::pg_lsn)
                      else pg_current_wal_insert_lsn() end - '0/0'::pg_lsn)::bigint;
    return query select replayed, null::bigint, null::text, null::text, null::text,
        null::timestamptz, null::timestamptz;
    return query select replayed, p.id, p.title, p.body, p.author, p.created_at, p.updated_at
        from posts p where p.id = any(ids);
end
$$;
