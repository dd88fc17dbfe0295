# Serve an exported NeMo multimodal model with Triton (PyTriton) on a PyTorch base image.
# Build:  docker build -t nemo-mm-deploy .
# Run:    docker run --shm-size=8g -p 8000:8000 -p 8001:8001 -p 8002:8002 nemo-mm-deploy   (the demo, on CPU)
#         docker run --gpus all --shm-size=8g -p 8000:8000 -p 8001:8001 -p 8002:8002 \
#           -v /path/to/checkpoints:/models nemo-mm-deploy \
#           --visual_checkpoint /models/neva.nemo --model_type neva --triton_model_name neva --device cuda
FROM nvcr.io/nvidia/pytorch:25.01-py3

WORKDIR /opt/nemo-mm-deploy
COPY pyproject.toml README.md ./
COPY exporter exporter
COPY deploy deploy
COPY query query
COPY wire wire
COPY scripts scripts
COPY configs configs
COPY demo demo
RUN python -m pip install --no-cache-dir -e ".[openai]"

EXPOSE 8000 8001 8002
ENTRYPOINT ["python", "scripts/deploy_triton.py", "--triton_http_address", "0.0.0.0"]
CMD ["--config", "configs/demo.yaml", "--visual_checkpoint", "demo/neva_demo.nemo"]
