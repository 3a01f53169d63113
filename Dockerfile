# The image docs/kubernetes/lingvo_ext_job.yaml runs (docs/clusters.md):
#   docker build -t lingvo-ext:latest .
# It installs as the README does: scripts/venv.sh makes .venv (Python 3.11,
# the pinned TensorFlow and Lingvo, this checkout editable) and runs the
# x_ops fix, which Lingvo's x_ops.so needs on this base's glibc (2.36, Debian
# 12). tests/test_dockerfile.py keeps the two in step.
FROM python:3.11-slim-bookworm
WORKDIR /opt/lingvo_ext
COPY . .
RUN bash scripts/venv.sh && rm -rf /root/.cache/pip
# The manifest's `python -m lingvo_ext.trainer` is the venv's Python.
ENV PATH=/opt/lingvo_ext/.venv/bin:$PATH
CMD ["python", "-m", "lingvo_ext.tools.list_models"]
