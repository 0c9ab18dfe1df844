create table if not exists posts (
    id bigint primary key,
    title text not null,
    body text not null,
    author text not null,
    created_at timestamptz not null default now(),
    updated_at timestamptz not null default now(),
    constraint posts_id_positive check (id > 0)
);
