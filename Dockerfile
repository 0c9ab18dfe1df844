# syntax=docker/dockerfile:1
# The release binary on a slim Debian base, run as a user of its own.
# Base images are pinned by version; pin them by digest too
# (`image:tag@sha256:...`) in the registry your builds pull from.
ARG RUST_IMAGE=rust:1.95.0-bookworm
ARG RUNTIME_IMAGE=debian:12.11-slim

# Build stage. The dependencies are built first, from Cargo.toml and
# Cargo.lock alone, in a layer of their own: a change to the sources
# rebuilds only the crate.
FROM ${RUST_IMAGE} AS build
WORKDIR /src
# Line tables only: backtraces keep their line numbers, the binary a
# fraction of the size the repository's release profile gives it.
ENV CARGO_PROFILE_RELEASE_DEBUG=line-tables-only
COPY Cargo.toml Cargo.lock ./
RUN mkdir src \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs \
    && cargo build --release --locked --bin postcache \
    && rm -rf src
COPY src ./src
COPY migrations ./migrations
# The placeholder's build is newer than the copied sources: make them newer.
RUN touch src/main.rs src/lib.rs \
    && cargo build --release --locked --bin postcache

# Run stage: the binary alone, no shell tools added (no curl: the
# HEALTHCHECK is `postcache healthcheck`).
FROM ${RUNTIME_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 postcache \
    && useradd --system --uid 10001 --gid postcache --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin postcache
COPY --from=build /src/target/release/postcache /usr/local/bin/postcache
# Numeric, so that Kubernetes' runAsNonRoot can check it.
USER 10001:10001
ENV LISTEN_ADDR=0.0.0.0:8080 \
    ADMIN_ADDR=0.0.0.0:9090
# 8080: posts; 9090: /livez, /readyz and /metrics, never shed.
EXPOSE 8080 9090
HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=3 \
    CMD ["postcache", "healthcheck"]
ENTRYPOINT ["postcache"]
CMD ["serve"]
