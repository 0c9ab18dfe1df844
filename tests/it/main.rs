//! The integration tests, in one binary: each module drives the real service
//! against the real PostgreSQL and Redis, each test in a world of its own
//! (`postcache::testkit`). The metrics test has a binary of its own: it
//! counts exact deltas of the process-wide recorder. What several modules
//! share beyond the testkit is in `support`.

mod api;
mod batch_reads;
mod batching;
mod changes;
mod cluster;
mod connections;
mod docs;
mod faults;
mod floors;
mod freshness;
mod gray;
mod guarantees;
mod guard;
mod harness;
mod lab;
mod load_path;
mod memory;
mod not_serving;
mod odd_rows;
mod processes;
mod read_your_writes;
mod replicas;
mod replication;
mod restarts;
mod scenarios;
mod single_flight;
mod support;
mod toolkit;
