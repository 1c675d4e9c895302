# tollgate in a container: `docker build --build-arg TOLLGATE_COMMIT=$(git rev-parse --short=12 HEAD) -t tollgate .`, then
#   docker run -p 8080:8080 -p 9901:9901 -e TOLLGATE_ADMIN_TOKEN=... tollgate
# Your own config: start from the image's (`docker run --rm --entrypoint cat tollgate
# /etc/tollgate/tollgate.yaml > tollgate.yaml`), then `-v $PWD/tollgate.yaml:/etc/tollgate/tollgate.yaml`.
# The image runs as an unprivileged user and holds the binary, CA roots and the default
# config (packaging/tollgate.yaml, its admin port open to the container's network behind
# TOLLGATE_ADMIN_TOKEN) only.

FROM rust:1-bookworm AS build
# The commit `tollgate --version` names (the build context holds no .git).
ARG TOLLGATE_COMMIT=""
ENV TOLLGATE_COMMIT=${TOLLGATE_COMMIT}
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
# In a container the admin port is reached from outside the container's own loopback, so
# it listens on every address, with its token from TOLLGATE_ADMIN_TOKEN (without one the
# gateway does not start) instead of the package's token file.
RUN sed -i -e 's|^  address: 127.0.0.1:9901$|  address: 0.0.0.0:9901|' \
        -e '\|^  token_file: /etc/tollgate/admin.token$|d' /etc/tollgate/tollgate.yaml \
    && grep -q '^  address: 0.0.0.0:9901$' /etc/tollgate/tollgate.yaml \
    && ! grep -q 'token_file' /etc/tollgate/tollgate.yaml
USER tollgate
EXPOSE 8080 9901
ENTRYPOINT ["/usr/bin/tollgate"]
CMD ["run", "--config", "/etc/tollgate/tollgate.yaml"]
