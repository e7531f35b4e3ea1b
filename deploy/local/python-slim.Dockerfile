# A stand-in for `python:3.11-slim` on a machine with no registry (this workplace; scripts/compose-up builds it).
#
# FROM: Debian bookworm made with debootstrap from Debian's mirror (python3, python3-venv, python3-dev,
# ca-certificates), imported as artgw-local/bookworm:rootfs. The official image keeps its Python under
# /usr/local (python, python3, pip on PATH, pip's packages in /usr/local/lib/python3.11/site-packages, console
# scripts in /usr/local/bin, the C headers that torch's inductor compiles against): a venv made *at* /usr/local
# gives the same layout on Debian's Python 3.11, without Debian's "externally managed" guard on pip.
# The host's CA bundle replaces Debian's: pip inside the project's build reaches PyPI through this host's TLS.
FROM artgw-local/bookworm:rootfs
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
# update-ca-certificates (any later package that runs it) rebuilds the bundle and keeps this file's certificates
COPY ca-certificates.crt /usr/local/share/ca-certificates/host-bundle.crt
RUN python3 -m venv /usr/local \
    && python --version && pip --version && python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])'
ENV LANG=C.UTF-8 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
LABEL org.artgw.local-standin="python:3.11-slim"
CMD ["python3"]
