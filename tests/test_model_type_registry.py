"""The model-type registry: each type is declared in its own module, and a new type added from one file is exported,
served through Triton and the OpenAI front, and queried by a client and a CLI that have never heard of it."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import types
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

import exporter.models
from deploy.openai import OpenAIServer, create_app
from exporter import TensorRTMMExporter
from exporter.models import ModelType, get_model_type, model_types, register_model_types
from query import NemoQueryMultimodal, QueryError
from support import picture_model_type
from support.demo import COLOR_Q, DEMO_IMAGES, DEMO_NEMO, SHAPE_Q, demo_deployed
from support.media import data_url
from support.ports import free_port
from wire import AUDIO, IMAGE, VIDEO, ServedModel

REPO = Path(__file__).resolve().parent.parent
NAME = "picture-neva"


def test_each_type_is_declared_in_its_own_module():
    expected = {"neva": "neva", "vila": "neva", "video-neva": "video_neva", "lita": "lita", "vita": "lita",
                "salm": "salm"}
    registered = model_types()
    assert set(expected) <= set(registered)
    for name, module in expected.items():
        kind = registered[name]
        assert kind in importlib.import_module(f"exporter.models.{module}").MODEL_TYPES
        assert get_model_type(name) is kind
    assert [registered[name].perception.media for name in ("neva", "video-neva", "salm")] == [
        (IMAGE,), (VIDEO, IMAGE), (AUDIO,)]
    assert [registered[name].modality for name in ("vila", "lita", "salm")] == ["vision", "vision", "audio"]
    assert registered["salm"].perception.placeholder is None and registered["lita"].perception.placeholder == "<video>"
    with pytest.raises(ValueError, match="unsupported model_type 'llava'; supported: lita, neva"):
        get_model_type("llava")


def test_a_taken_name_or_a_bad_declaration_is_refused():
    clash = types.ModuleType("clash")
    clash.MODEL_TYPES = (type(get_model_type("neva"))("neva"),)
    with pytest.raises(ValueError, match="model_type 'neva' of clash is taken by exporter.models.neva.ImageModel"):
        register_model_types(clash)
    clash.MODEL_TYPES = [get_model_type("neva")]
    with pytest.raises(TypeError, match="clash.MODEL_TYPES must be a tuple of ModelType"):
        register_model_types(clash)
    assert register_model_types(importlib.import_module("exporter.models.neva"))  # the same types again: no change


def test_served_facts_come_from_the_triton_config():
    config = {"max_batch_size": 4, "input": [{"name": "input_text"}],
              "parameters": {"model_type": {"string_value": "lita"}, "media": {"string_value": "video,image"}}}
    assert ServedModel.from_config(config) == ServedModel("lita", (VIDEO, IMAGE), 4)
    unpublished = {"max_batch_size": 2, "input": [{"name": "input_text"}, {"name": "input_signal"}]}
    assert ServedModel.from_config(unpublished) == ServedModel(None, (AUDIO,), 2)
    with pytest.raises(ValueError, match="unknown media kind 'smell'"):
        ServedModel.from_config({"parameters": {"media": {"string_value": "smell"}}})


@pytest.fixture(scope="module")
def picture_type() -> Iterator[ModelType]:
    """The throwaway type, registered for this module's tests only."""
    (kind,) = register_model_types(picture_model_type)
    yield kind
    del exporter.models._REGISTRY[kind.name]  # the registry offers no removal: nothing else needs one


def _encoder_batches(perception, count: int) -> list[int]:
    """The batch size of each encoder call while `count` images are encoded."""
    sizes: list[int] = []
    hook = perception.encoder.register_forward_hook(lambda module, args, output: sizes.append(args[0].shape[0]))
    try:
        image = perception.load_media(str(DEMO_IMAGES / "red_circle.png"))[0]
        perception.encode([image] * count)
    finally:
        hook.remove()
    return sizes


def test_vision_max_batch_size_sets_the_encoder_micro_batch(tmp_path, picture_type):
    """The type's `encoder_batch` is the default (recorded in the manifest); `vision_max_batch_size` overrides it."""
    exporter = TensorRTMMExporter(tmp_path / "default", device="cpu")
    exporter.export(DEMO_NEMO, model_type=NAME, dtype="float32", max_batch_size=2, max_multimodal_len=256)
    manifest = json.loads((tmp_path / "default" / "manifest.json").read_text())
    assert manifest["limits"]["vision_max_batch_size"] == 3
    assert _encoder_batches(exporter.engine.perception, 7) == [3, 3, 1]
    exporter.export(DEMO_NEMO, model_type=NAME, dtype="float32", max_batch_size=2, max_multimodal_len=256,
                    vision_max_batch_size=2)
    assert _encoder_batches(exporter.engine.perception, 5) == [2, 2, 1]
    neva = TensorRTMMExporter(tmp_path / "neva", device="cpu")
    neva.export(DEMO_NEMO, model_type="neva", dtype="float32", max_multimodal_len=256)
    assert neva.engine.limits.vision_max_batch_size == 16 and _encoder_batches(neva.engine.perception, 17) == [16, 1]
    features = neva.engine.perception.encode(neva.engine.perception.load_media(str(DEMO_IMAGES / "red_circle.png")))
    torch.testing.assert_close(features[0], exporter.engine.perception.encode(
        exporter.engine.perception.load_media(str(DEMO_IMAGES / "red_circle.png")))[0])


@pytest.fixture(scope="module")
def served_picture_type(tmp_path_factory, picture_type):
    with demo_deployed(tmp_path_factory.mktemp("engine"), max_batch_size=2, max_output_len=8,
                       model_type=NAME) as (http, grpc, deployer):
        front = OpenAIServer(create_app(deployer.model, "pictures"), host="127.0.0.1", port=free_port())
        front.start()
        try:
            yield http, grpc, front.url
        finally:
            front.stop()


def test_a_type_added_from_one_file_is_served(served_picture_type):
    http, grpc, openai_url = served_picture_type
    with urllib.request.urlopen(f"http://{http}/v2/models/demo/config", timeout=30) as response:
        parameters = json.loads(response.read())["parameters"]
    assert parameters["model_type"] == {"string_value": NAME} and parameters["media"] == {"string_value": "image"}

    for url in (http, grpc):
        with NemoQueryMultimodal(url, "demo", NAME) as client:
            assert client.query([SHAPE_Q, f"<picture>\n{COLOR_Q}"], str(DEMO_IMAGES / "blue_triangle.png"),
                                max_output_len=4).tolist() == [["triangle"], ["blue"]]
            with pytest.raises(QueryError, match=r"at most 2 images per request, got 3 media items") as failure:
                client.query(SHAPE_Q, [[str(DEMO_IMAGES / "red_circle.png")] * 3], max_output_len=4)
            assert failure.value.status in ("400", "StatusCode.INVALID_ARGUMENT")
    with NemoQueryMultimodal(http, "demo", "neva") as client, pytest.raises(QueryError, match="is a 'picture-neva'"):
        client.query(SHAPE_Q, str(DEMO_IMAGES / "red_circle.png"))

    cli = subprocess.run([sys.executable, str(REPO / "scripts" / "query.py"), "-u", http, "-mn", "demo", "-mt", NAME,
                          "-im", str(DEMO_IMAGES / "green_square.png"), "-int", COLOR_Q, "-mol", "4"],
                         capture_output=True, text=True, timeout=120)
    assert (cli.returncode, cli.stdout) == (0, "green\n"), cli.stderr

    chat = openai.OpenAI(base_url=openai_url, api_key="unused", timeout=60, max_retries=0)
    picture = {"type": "image_url", "image_url": {"url": data_url((DEMO_IMAGES / "yellow_circle.png").read_bytes())}}
    answer = chat.chat.completions.create(model="pictures", max_tokens=4, messages=[
        {"role": "user", "content": [picture, {"type": "text", "text": COLOR_Q}]}])
    assert answer.choices[0].message.content == "yellow"
    placed = chat.chat.completions.create(model="pictures", max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": f"<picture>\n{SHAPE_Q}"}, picture]}])
    assert placed.choices[0].message.content == "circle"
    with pytest.raises(openai.BadRequestError, match="at most 2 images per request"):
        chat.chat.completions.create(model="pictures", max_tokens=4, messages=[
            {"role": "user", "content": [picture] * 3 + [{"type": "text", "text": SHAPE_Q}]}])
    with pytest.raises(openai.BadRequestError, match="this model takes image_url"):
        chat.chat.completions.create(model="pictures", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}])
