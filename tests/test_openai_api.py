"""The OpenAI-compatible front against real servers on loopback, queried with the `openai` package and curl.

The demo Neva (which names the shape and colour in 64x64 pictures, one word per answer) checks answers against the
Triton path and the pictures' labels; a tiny random Neva, which talks until max_tokens, checks sampling, stop
strings, long streams and cancellation.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import openai
import pytest
import sentencepiece
from PIL import Image

from deploy.openai import create_app
from exporter import TensorRTMMExporter
from exporter.llm.generate import SamplingParams
from exporter.media_safety import MediaPolicy
from exporter.runtime import Request
from exporter.runtime import pipeline as pipeline_module
from query import NemoQueryMultimodal
from support.demo import COLOR_Q, DEMO_IMAGES, MODEL, SHAPE_Q, load_demo_builder
from support.media import data_url, encode_mp4, png_bytes, random_image
from support.media_host import MediaHost
from support.openai_front import assert_error_object, chat, client, image_message, serving
from support.ports import free_port
from support.salm import build_salm, write_clips
from support.servers import REPO, get, poll_ready, post, stop_server, wait_until_ready
from support.tokenizer_files import tokenizer_file
from support.vlm import VIDEO_TYPES, build_vlm, tiny_neva

LABELS = {"red_circle": ("circle", "red"), "blue_triangle": ("triangle", "blue"),
          "green_square": ("square", "green"), "yellow_circle": ("circle", "yellow")}
BABBLE_MAX_OUTPUT = 300


# --- helpers --------------------------------------------------------------------------------------------------------


def noise_png(size: int) -> bytes:
    """A PNG of random pixels (it does not compress: about 3 bytes a pixel)."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(size).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


# --- fixtures -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(demo_server):
    """(Triton HTTP address, the exporter behind it, the OpenAI base URL over the same exporter)."""
    http_url, _, deployer = demo_server
    with serving(create_app(deployer.model, MODEL)) as url:
        yield http_url, deployer.model, url


@pytest.fixture(scope="module")
def babbler(tmp_path_factory):
    """(exporter, OpenAI base URL, image) of a tiny random Neva that rarely says EOS."""
    exporter = tiny_neva(tmp_path_factory.mktemp("babbler"), BABBLE_MAX_OUTPUT, max_batch_size=4)
    with serving(create_app(exporter, "babbler")) as url:
        yield exporter, url, random_image(3)


def stream_chunks(url: str, question: str, image: bytes, model: str = MODEL, **params) -> list:
    with client(url).chat.completions.create(model=model, messages=image_message(question, data_url(image)),
                                             stream=True, **params) as chunks:
        return list(chunks)


# --- the demo model: answers, streams, usage ------------------------------------------------------------------------

def test_models_and_health(demo):
    _, _, url = demo
    api = client(url)
    assert [model.id for model in api.models.list()] == [MODEL]
    card = api.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "nemo-mm-deploy")
    assert get(url + "/health/live") == (200, {"status": "live"})
    assert get(url + "/health/ready") == (200, {"status": "ready"})
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("not-served")


@pytest.mark.parametrize("name", sorted(LABELS))
def test_image_as_data_url_answers_as_the_triton_path(demo, name):
    triton_url, _, url = demo
    image = (DEMO_IMAGES / f"{name}.png").read_bytes()
    with NemoQueryMultimodal(triton_url, MODEL, "neva") as triton:
        for question, label in zip((SHAPE_Q, COLOR_Q), LABELS[name]):
            answer = chat(url, question, image)
            assert answer.object == "chat.completion" and answer.model == MODEL
            (choice,) = answer.choices
            assert (choice.message.role, choice.finish_reason) == ("assistant", "stop")
            expected = triton.query(question, str(DEMO_IMAGES / f"{name}.png"), max_output_len=16)[0, 0]
            assert choice.message.content == expected == label


def test_stream_is_openai_chunks_that_join_to_the_answer(demo):
    _, _, url = demo
    image = (DEMO_IMAGES / "blue_triangle.png").read_bytes()
    whole = chat(url, COLOR_Q, image)
    chunks = stream_chunks(url, COLOR_Q, image, stream_options={"include_usage": True})
    assert len({chunk.id for chunk in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    first, *middle, last_choice, usage = chunks
    assert first.choices[0].delta.role == "assistant" and not first.choices[0].delta.content
    assert [c.choices[0].finish_reason for c in (first, *middle)] == [None] * (1 + len(middle))
    assert last_choice.choices[0].finish_reason == "stop" and not last_choice.choices[0].delta.content
    assert usage.choices == [] and usage.usage == whole.usage
    assert "".join(c.choices[0].delta.content for c in middle) == whole.choices[0].message.content == "blue"
    plain = stream_chunks(url, COLOR_Q, image)
    assert all(chunk.usage is None for chunk in plain) and plain[-1].choices[0].finish_reason == "stop"


def test_usage_counts_prompt_positions_and_generated_tokens(demo):
    _, exporter, url = demo
    sp = sentencepiece.SentencePieceProcessor(model_file=str(exporter.model_dir / "llm_engine" / "tokenizer.model"))
    before, after = load_demo_builder().prompt_pieces(sp, SHAPE_Q)  # how training laid the prompt out
    answer = chat(url, SHAPE_Q, (DEMO_IMAGES / "green_square.png").read_bytes())
    generated = sp.encode(answer.choices[0].message.content)
    assert answer.usage.prompt_tokens == len(before) + exporter.engine.perception.features_per_item + len(after)
    assert answer.usage.completion_tokens == len(generated)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_system_prompt_and_placeholder_in_text(demo):
    _, exporter, url = demo
    image = (DEMO_IMAGES / "red_circle.png").read_bytes()
    placed = [{"role": "user", "content": [{"type": "text", "text": "<image>\n" + SHAPE_Q},
                                           {"type": "image_url", "image_url": {"url": data_url(image)}}]}]
    answer = client(url).chat.completions.create(model=MODEL, messages=placed)
    assert answer.choices[0].message.content == "circle"
    system = "You name shapes."
    with_system = client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": system}, *image_message(SHAPE_Q, data_url(image))])
    params = SamplingParams(max_output_len=16)
    alone = exporter.generate([Request(SHAPE_Q, image, params, system=system + " ")])[0]
    assert with_system.choices[0].message.content == alone.texts[0]
    assert with_system.usage.prompt_tokens == alone.prompt_tokens


# --- errors ---------------------------------------------------------------------------------------------------------

def _bad_bodies(image_url: str) -> dict[str, tuple[dict | bytes, int, tuple[str, ...]]]:
    def ask(**extra) -> dict:
        return {"model": MODEL, "messages": image_message(SHAPE_Q, image_url), **extra}

    garbage = data_url(b"\x89PNG\r\n\x1a\n not really a picture")
    return {
        "bad JSON": (b'{"model": "demo", "messages": [', 400, ("not valid JSON",)),
        "not media": ({"model": MODEL, "messages": image_message(SHAPE_Q, garbage)}, 400, ("image",)),
        "bad base64": ({"model": MODEL, "messages": image_message(SHAPE_Q, "data:image/png;base64,@@@")}, 400,
                       ("base64",)),
        "unknown model": ({**ask(), "model": "gpt-4o"}, 404, ("gpt-4o", "demo")),
        "temperature": (ask(temperature=5), 422, ("temperature",)),
        "top_p": (ask(top_p=-0.5), 422, ("top_p",)),
        "n": (ask(n=2), 422, ("n must be 1",)),
        "no messages": ({"model": MODEL, "messages": []}, 422, ("messages",)),
        "missing model": ({"messages": image_message(SHAPE_Q, image_url)}, 422, ("model",)),
        "max_tokens": (ask(max_tokens=10_000), 400, ("max_tokens=10000", "16")),
        "prompt too long": ({"model": MODEL, "messages": image_message("tell me " * 300, image_url)}, 400,
                            ("max_input_len",)),
        "assistant turn": ({"model": MODEL, "messages": [*image_message(SHAPE_Q, image_url),
                                                           {"role": "assistant", "content": "circle"}]}, 400,
                           ("assistant",)),
        "video to an image model": ({"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": image_url}}]}]}, 400, ("video_url", "image_url")),
    }


@pytest.mark.parametrize("case", sorted(_bad_bodies("")))
def test_bad_requests_get_openai_error_objects(demo, case):
    _, _, url = demo
    body, status, words = _bad_bodies(data_url((DEMO_IMAGES / "red_circle.png").read_bytes()))[case]
    assert_error_object(*post(url + "/chat/completions", body), status, *words)


def test_unknown_route_and_openai_exceptions(demo):
    _, _, url = demo
    assert_error_object(*get(url + "/completions/nothing"), 404)
    image = (DEMO_IMAGES / "red_circle.png").read_bytes()
    with pytest.raises(openai.NotFoundError) as unknown:
        chat(url, SHAPE_Q, image, model="gpt-4o")
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.UnprocessableEntityError):
        chat(url, SHAPE_Q, image, temperature=3)
    with pytest.raises(openai.BadRequestError) as bad:
        chat(url, SHAPE_Q, b"GIF89a broken")
    assert bad.value.code == "invalid_media"
    # a stream that fails before any text still gets its status, not a 200 with an error event
    with pytest.raises(openai.BadRequestError):
        stream_chunks(url, "tell me " * 300, image)


def test_oversized_media_and_bodies_get_413(demo):
    _, exporter, _ = demo
    big = noise_png(64)  # ~12 kB, 4096 pixels
    ask = {"model": MODEL, "messages": image_message(SHAPE_Q, data_url(big))}
    with serving(create_app(exporter, MODEL, MediaPolicy(max_bytes=4000))) as url:
        assert_error_object(*post(url + "/chat/completions", ask), 413, "max_bytes")
    with serving(create_app(exporter, MODEL, MediaPolicy(max_image_pixels=4000))) as url:
        assert_error_object(*post(url + "/chat/completions", ask), 413, "pixels")
    with serving(create_app(exporter, MODEL, max_request_bytes=12_000)) as url:
        assert_error_object(*post(url + "/chat/completions", ask), 413, "openai_max_request_bytes")
        small = {"model": MODEL, "messages": image_message(SHAPE_Q, data_url((DEMO_IMAGES / "red_circle.png")
                                                                             .read_bytes()))}
        assert post(url + "/chat/completions", small)[1]["choices"][0]["message"]["content"] == "circle"
    with serving(create_app(exporter, MODEL, MediaPolicy(max_items=1))) as url:
        two = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(big)}}] * 2}]
        assert_error_object(*post(url + "/chat/completions", {"model": MODEL, "messages": two}), 400,
                            "media_max_items")


def test_not_ready_answers_503(demo, tmp_path):
    _, exporter, _ = demo
    ask = {"model": MODEL, "messages": image_message(SHAPE_Q, data_url((DEMO_IMAGES / "red_circle.png").read_bytes()))}
    app = create_app(exporter, MODEL)
    with serving(app) as url:
        app.state.ready = False  # what stop() sets while requests drain
        assert_error_object(*post(url + "/chat/completions", ask), 503, "not ready")
        assert_error_object(*get(url + "/health/ready"), 503)
        assert get(url + "/health/live")[0] == 200
        app.state.ready = True
        assert post(url + "/chat/completions", ask)[0] == 200
    unloaded = TensorRTMMExporter(tmp_path, load_model=False)
    with serving(create_app(unloaded, MODEL)) as url:
        assert_error_object(*post(url + "/chat/completions", ask), 503, "not loaded")
        assert_error_object(*get(url + "/health/ready"), 503)


def test_a_model_failure_answers_500(demo, monkeypatch):
    _, exporter, url = demo

    def failing(*_):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(exporter, "generate", lambda requests: [RuntimeError("the device fell over")] * len(requests))
    monkeypatch.setattr(exporter, "stream", failing)
    ask = {"model": MODEL, "messages": image_message(SHAPE_Q, data_url((DEMO_IMAGES / "red_circle.png").read_bytes()))}
    assert_error_object(*post(url + "/chat/completions", ask), 500, "the device fell over")
    assert_error_object(*post(url + "/chat/completions", {**ask, "stream": True}), 500, "the device fell over")


# --- media sources and their policy ---------------------------------------------------------------------------------

def test_media_urls_follow_the_policy(demo):
    _, exporter, _ = demo
    ask_url = "{}/red_circle.png"
    with MediaHost(folder=DEMO_IMAGES) as media_host:
        host = media_host.url
        body = {"model": MODEL, "messages": image_message(SHAPE_Q, ask_url.format(host))}
        with serving(create_app(exporter, MODEL)) as url:  # default: only public addresses
            assert_error_object(*post(url + "/chat/completions", body), 400, "media_allow_private_networks")
        with serving(create_app(exporter, MODEL, MediaPolicy(allow_private_networks=True))) as url:
            assert post(url + "/chat/completions", body)[1]["choices"][0]["message"]["content"] == "circle"
            missing = {"model": MODEL, "messages": image_message(SHAPE_Q, host + "/nothing.png")}
            assert_error_object(*post(url + "/chat/completions", missing), 400, "404")
        listed = MediaPolicy(allow_private_networks=True, allowed_domains=("images.example.com",))
        with serving(create_app(exporter, MODEL, listed)) as url:
            assert_error_object(*post(url + "/chat/completions", body), 400, "allow-list", "127.0.0.1")
        listed = MediaPolicy(allow_private_networks=True, allowed_domains=("127.0.0.1",))
        with serving(create_app(exporter, MODEL, listed)) as url:
            assert post(url + "/chat/completions", body)[0] == 200


def test_local_files_only_from_the_allowed_folder(demo):
    _, exporter, _ = demo
    inside = {"model": MODEL, "messages": image_message(COLOR_Q, (DEMO_IMAGES / "yellow_circle.png").as_uri())}
    outside = {"model": MODEL, "messages": image_message(COLOR_Q, (REPO / "README.md").as_uri())}
    with serving(create_app(exporter, MODEL)) as url:
        assert_error_object(*post(url + "/chat/completions", inside), 400, "media_local_dir")
    with serving(create_app(exporter, MODEL, MediaPolicy(local_dir=str(DEMO_IMAGES)))) as url:
        assert post(url + "/chat/completions", inside)[1]["choices"][0]["message"]["content"] == "yellow"
        assert_error_object(*post(url + "/chat/completions", outside), 400, "outside")


# --- the babbling model: sampling, stops, long streams, cancellation ------------------------------------------------

def test_max_tokens_ends_with_length_and_greedy_matches_the_exporter(babbler):
    exporter, url, image = babbler
    answer = chat(url, "describe the image", png_bytes(image), model="babbler", max_tokens=9)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 9
    assert [[answer.choices[0].message.content]] == exporter.forward("describe the image", image, max_output_len=9)


def test_temperature_top_p_and_seed(babbler):
    _, url, image = babbler
    data = png_bytes(image)

    def text(**params) -> str:
        return chat(url, "describe the image", data, model="babbler", max_tokens=24, **params).choices[0].message.content

    greedy = text()
    assert text(temperature=0) == greedy
    sampled = text(temperature=1.0, seed=11)
    assert text(temperature=1.0, seed=11) == sampled != greedy
    assert text(temperature=1.0, seed=12) != sampled
    assert text(temperature=1.0, top_p=1e-6, seed=13) == greedy  # the nucleus holds the top token alone


def test_stop_strings_cut_the_answer(babbler):
    _, url, image = babbler
    data = png_bytes(image)
    full = chat(url, "describe the image", data, model="babbler", max_tokens=40).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = full[:full.index(stop)]
    answer = chat(url, "describe the image", data, model="babbler", max_tokens=40, stop=[stop, "never said"])
    assert answer.choices[0].message.content == cut and answer.choices[0].finish_reason == "stop"
    chunks = stream_chunks(url, "describe the image", data, model="babbler", max_tokens=40, stop=stop)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_long_stream_joins_to_the_answer(babbler):
    _, url, image = babbler
    data = png_bytes(image)
    whole = chat(url, "describe the image", data, model="babbler", max_tokens=60)
    chunks = stream_chunks(url, "describe the image", data, model="babbler", max_tokens=60,
                           stream_options={"include_usage": True})
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].message.content  # fewer on a busy machine
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage == whole.usage


def test_a_slow_stream_consumer_gets_fewer_longer_pieces(babbler):
    """Tokens generated while the consumer was away come as one piece: a busy server sends fewer responses, and
    the pieces still join to the answer."""
    exporter, _, image = babbler
    request = Request("describe the image", png_bytes(image), SamplingParams(max_output_len=60))
    (whole,) = exporter.generate([request])
    pieces = []
    for piece in exporter.stream(request):
        pieces.append(piece)
        time.sleep(0.05)
    assert "".join(pieces) == whole.texts[0]
    assert len(pieces) <= len(whole.token_ids[0]) // 2


def test_many_streams_space_their_pieces(babbler, monkeypatch):
    """Pieces of one stream are (streams running) / STREAM_PIECES_PER_S apart: at a low rate four streams get
    pieces of several tokens that still join to the answer, and a lone stream at the default rate gets more pieces
    than one of the four."""
    exporter, _, image = babbler
    request = Request("describe the image", png_bytes(image), SamplingParams(max_output_len=60))
    (whole,) = exporter.generate([request])
    alone = list(exporter.stream(request))
    monkeypatch.setattr(pipeline_module, "STREAM_PIECES_PER_S", 40.0)  # 4 streams: a piece each 0.1 s at most
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        paced = list(pool.map(lambda _: list(exporter.stream(request)), range(4)))
    assert "".join(alone) == whole.texts[0] and all("".join(pieces) == whole.texts[0] for pieces in paced)
    assert max(len(pieces) for pieces in paced) < len(alone)


def test_a_paced_stream_ends_with_its_last_token_not_a_pause_later(babbler, monkeypatch):
    """The end of the answer ends the pause between pieces at once: at a piece each 10 s, the answer (well under
    a second of generation here) still streams in about the time of a plain generate, its tokens in two pieces."""
    exporter, _, image = babbler
    request = Request("describe the image", png_bytes(image), SamplingParams(max_output_len=30))
    started = time.monotonic()
    (whole,) = exporter.generate([request])
    generate_s = time.monotonic() - started
    monkeypatch.setattr(pipeline_module, "STREAM_PIECES_PER_S", 0.1)
    started = time.monotonic()
    pieces = list(exporter.stream(request))
    assert "".join(pieces) == whole.texts[0] and len(pieces) <= 3
    assert time.monotonic() - started < generate_s + 5.0


def test_closing_a_stream_cancels_its_generation(babbler, monkeypatch):
    exporter, url, image = babbler
    scheduler = exporter.pipeline.scheduler
    handles = []
    submit, step = scheduler.submit, scheduler.step

    def recorded_submit(*args, **kwargs):
        handles.append(submit(*args, **kwargs))
        return handles[-1]

    def slow_step():  # ~5 ms a token, so that the whole answer would take over a second
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(scheduler, "submit", recorded_submit)
    monkeypatch.setattr(scheduler, "step", slow_step)
    with client(url).chat.completions.create(model="babbler", stream=True, max_tokens=BABBLE_MAX_OUTPUT,
                                             messages=image_message("describe the image",
                                                                    data_url(png_bytes(image)))) as chunks:
        for chunk in chunks:
            if chunk.choices[0].delta.content:
                break  # the client goes away after the first text
    (handle,) = handles
    assert handle.wait(timeout=30)
    assert handle.cancelled and len(handle.tokens) < BABBLE_MAX_OUTPUT // 2, len(handle.tokens)
    assert not any(scheduler.slots) and not scheduler.waiting
    assert chat(url, "describe the image", png_bytes(image), model="babbler", max_tokens=3).usage.completion_tokens == 3


def test_video_model_takes_video_url_and_image_url(tmp_path):
    vlm = build_vlm(tmp_path / "ckpt", tokenizer_file(tmp_path), **VIDEO_TYPES["video-neva"])
    exporter = TensorRTMMExporter(tmp_path / "engine", device="cpu")
    exporter.export(vlm.nemo, model_type="video-neva", dtype="float32", max_batch_size=2, max_input_len=512,
                    max_output_len=8, max_multimodal_len=2 * 128, vision_max_batch_size=16)
    video = tmp_path / "clip.mp4"
    video.write_bytes(encode_mp4(4, 7))
    picture = png_bytes(random_image(5))
    with serving(create_app(exporter, "video")) as url:
        content = [{"type": "text", "text": "describe the video"},
                   {"type": "video_url", "video_url": {"url": data_url(video.read_bytes(), "video/mp4")}}]
        answer = client(url).chat.completions.create(model="video", max_tokens=5,
                                                     messages=[{"role": "user", "content": content}])
        assert [[answer.choices[0].message.content]] == exporter.forward("describe the video", str(video),
                                                                          max_output_len=5)
        assert answer.choices[0].finish_reason == "length"  # a random model rarely says EOS in 5 tokens
        still = chat(url, "what is in this picture", picture, model="video", max_tokens=5)  # one-frame video
        assert [[still.choices[0].message.content]] == exporter.forward("what is in this picture", picture,
                                                                         max_output_len=5)
        broken = [{"type": "video_url", "video_url": {"url": data_url(b"\0\0\0\x18ftypmp42 cut", "video/mp4")}}]
        assert_error_object(*post(url + "/chat/completions", {"model": "video", "messages": [
            {"role": "user", "content": broken}]}), 400, "video")


def test_audio_model_takes_input_audio(tmp_path):
    salm = build_salm(tmp_path / "salm")
    clips = write_clips(tmp_path / "clips")
    exporter = TensorRTMMExporter(tmp_path / "engine", modality="audio", device="cpu")
    exporter.export(salm.nemo, model_type="salm", dtype="float32", max_batch_size=2, max_input_len=256,
                    max_output_len=8, max_multimodal_len=256)
    with serving(create_app(exporter, "salm")) as url:
        for path, audio_format in ((clips.wav, "wav"), (clips.mp3, "mp3")):
            content = [{"type": "input_audio", "input_audio": {
                "data": base64.b64encode(path.read_bytes()).decode(), "format": audio_format}}]
            answer = client(url).chat.completions.create(model="salm", max_tokens=6,
                                                         messages=[{"role": "user", "content": content}])
            assert [[answer.choices[0].message.content]] == exporter.forward("", str(path), max_output_len=6)
        image = [{"type": "image_url", "image_url": {"url": data_url(noise_png(8))}}]
        assert_error_object(*post(url + "/chat/completions", {"model": "salm", "messages": [
            {"role": "user", "content": image}]}), 400, "input_audio")
    exporter.pipeline.close()


# --- the deploy script with --openai_port, and curl -----------------------------------------------------------------

def test_deploy_script_serves_openai_and_curl_gets_plain_and_streamed_answers(demo, tmp_path):
    _, exporter, _ = demo
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    http_port, grpc_port, openai_port = free_port(), free_port(), free_port()
    deploy = [sys.executable, str(REPO / "scripts/deploy_triton.py"), "--config", "demo", "-tmr",
              str(exporter.model_dir), "-trp", str(http_port), "--grpc_port", str(grpc_port), "-mbs", "2",
              "--openai_port", str(openai_port), "--media_max_bytes", "10000"]
    server = subprocess.Popen(deploy, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_ready(f"127.0.0.1:{http_port}", MODEL, server)
        url = f"http://127.0.0.1:{openai_port}/v1"
        poll_ready(server, url + "/health/ready")  # the OpenAI front starts once Triton is up
        assert [model.id for model in client(url).models.list()] == [MODEL]
        image = data_url((DEMO_IMAGES / "green_square.png").read_bytes())
        body = json.dumps({"model": MODEL, "messages": image_message(SHAPE_Q, image), "max_tokens": 8})
        plain = subprocess.run(["curl", "-sS", f"{url}/chat/completions", "-H", "Content-Type: application/json",
                                "-d", body], capture_output=True, text=True, timeout=60, check=True)
        assert json.loads(plain.stdout)["choices"][0]["message"]["content"] == "square"
        streamed = subprocess.run(["curl", "-sSN", f"{url}/chat/completions", "-H", "Content-Type: application/json",
                                   "-d", body[:-1] + ', "stream": true}'], capture_output=True, text=True,
                                  timeout=60, check=True)
        events = [line.removeprefix("data: ") for line in streamed.stdout.splitlines() if line]
        assert all(line.startswith("data: ") for line in streamed.stdout.splitlines() if line)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "square"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        big = {"model": MODEL, "messages": image_message(SHAPE_Q, data_url(noise_png(64)))}
        assert_error_object(*post(f"{url}/chat/completions", big), 413, "max_bytes")  # --media_max_bytes
        with MediaHost(folder=DEMO_IMAGES) as host:  # --media_allow_private_networks is off
            remote = {"model": MODEL, "messages": image_message(SHAPE_Q, host.url + "/green_square.png")}
            assert_error_object(*post(f"{url}/chat/completions", remote), 400, "media_allow_private_networks")
    finally:
        stop_server(server, 120)
    assert server.returncode == 0, server.stderr.read()
