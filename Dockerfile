# syntax=docker/dockerfile:1
#
# sidelock container image: built with cargo, run from a distroless base as a
# non-root user.
#
#   docker build -t ghcr.io/sidelock/sidelock:0.1.0 .
#   docker run --rm -p 7070:7070 ghcr.io/sidelock/sidelock:0.1.0 serve --listen 0.0.0.0:7070
#
# It matches the Helm chart's defaults (helm/sidelock/values.yaml): UID/GID
# 65532, port 7070, entrypoint `sidelock` (the chart passes
# `serve --config /etc/sidelock/sidelock.toml`), nothing written to the
# filesystem (the chart sets readOnlyRootFilesystem). Without arguments it runs
# `sidelock serve` with sidelock's own defaults (listen 127.0.0.1:7070, which is
# what a sidecar sharing the application's network namespace uses).

ARG RUST_VERSION=1.95
# The build stage and the runtime image must share the glibc: bookworm = Debian 12.
ARG DEBIAN_CODENAME=bookworm

FROM rust:${RUST_VERSION}-slim-${DEBIAN_CODENAME} AS build
WORKDIR /src
# The whole (filtered, see .dockerignore) context: Cargo.toml, Cargo.lock,
# src/, templates/ and static/ (compiled into the binary), tests/ for the
# manifest's test targets.
COPY . .
# Cache mounts keep the crate registry and target/ between builds, so a source
# change rebuilds only the sidelock crate.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked --bin sidelock \
 && install -D -m 0755 target/release/sidelock /out/sidelock

# distroless/cc: glibc, libgcc, CA certificates, tzdata and OpenSSL; no shell,
# no package manager. The :nonroot tag's default user is 65532.
FROM gcr.io/distroless/cc-debian12:nonroot
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="sidelock" \
      org.opencontainers.image.description="Distributed-lock sidecar: safe locks, leases, fencing and semaphores over HTTP" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"
COPY --from=build /out/sidelock /usr/local/bin/sidelock
USER 65532:65532
EXPOSE 7070
ENTRYPOINT ["/usr/local/bin/sidelock"]
CMD ["serve"]
