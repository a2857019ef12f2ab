# syntax=docker/dockerfile:1
# Image of the endpoint-auth binary: the HTTP external-authorization service Envoy Gateway's
# SecurityPolicy calls in each DI namespace. Build from the repository root:
#   docker build -f deploy/images/endpoint-auth.Dockerfile -t dedicated-inference/endpoint-auth:TAG .

FROM rust:1-bookworm AS build
WORKDIR /src
# Only what the workspace needs to compile: every member's manifest and source, the embedded
# migrations and catalog. Cargo.lock is honoured as committed (--locked).
COPY Cargo.toml Cargo.lock ./
COPY services services
COPY tests tests
COPY migrations migrations
COPY catalog catalog
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p endpoint-auth \
    && install -D -m 0755 target/release/endpoint-auth /out/endpoint-auth

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin app
COPY --from=build /out/endpoint-auth /usr/local/bin/endpoint-auth
# Numeric, so Kubernetes can verify runAsNonRoot without a runAsUser of its own.
USER 10001:10001
EXPOSE 8080
# The binary shuts down on SIGINT; as PID 1 without a handler it would ignore SIGTERM.
STOPSIGNAL SIGINT
ENTRYPOINT ["/usr/local/bin/endpoint-auth"]
