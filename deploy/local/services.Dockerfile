# Stand-ins for `postgres:16` and `prom/prometheus` on a machine with no registry (scripts/compose-up builds
# them with --target postgres / --target prometheus): Debian bookworm's packages on the debootstrap rootfs.
# PostgreSQL is Debian's 15 (bookworm has no 16): the store needs nothing of 16. Prometheus is Debian's 2.42.
FROM artgw-local/bookworm:rootfs AS services
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
# no "main" cluster at install time: the entrypoint makes the cluster in the volume, as the official image does
RUN mkdir -p /etc/postgresql-common \
    && echo 'create_main_cluster = false' > /etc/postgresql-common/createcluster.conf \
    && apt-get update \
    && apt-get install -y --no-install-recommends postgresql-15 prometheus wget \
    && rm -rf /var/lib/apt/lists/*

FROM services AS postgres
# what the official image's entrypoint does with POSTGRES_USER/PASSWORD/DB on an empty PGDATA
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
RUN mkdir -p "$PGDATA" /var/run/postgresql && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
LABEL org.artgw.local-standin="postgres:16"
VOLUME /var/lib/postgresql/data
STOPSIGNAL SIGINT
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["postgres"]

FROM services AS prometheus
# the official image: /bin/prometheus as nobody, data in /prometheus, the config at /etc/prometheus/prometheus.yml
# (/bin is /usr/bin on bookworm: /bin/prometheus is there already)
RUN mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
LABEL org.artgw.local-standin="prom/prometheus"
VOLUME /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
