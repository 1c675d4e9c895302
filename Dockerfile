# tollgate in a container: `docker build -t tollgate .`, then
#   docker run -p 8080:8080 -e TOLLGATE_ADMIN_TOKEN=... -v $PWD/tollgate.yaml:/etc/tollgate/tollgate.yaml tollgate
# The image runs as an unprivileged user and holds the binary, CA roots and the default
# config (packaging/tollgate.yaml) only.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p tollgate

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --no-create-home --shell /usr/sbin/nologin tollgate \
    && mkdir -p /etc/tollgate /var/lib/tollgate \
    && chown tollgate:tollgate /var/lib/tollgate
COPY --from=build /src/target/release/tollgate /usr/bin/tollgate
COPY packaging/tollgate.yaml /etc/tollgate/tollgate.yaml
USER tollgate
EXPOSE 8080
ENTRYPOINT ["/usr/bin/tollgate"]
CMD ["run", "--config", "/etc/tollgate/tollgate.yaml"]
