"""MediaPolicy limits on fetching (URLs, data: URLs, local files) and header-level content checks."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from exporter.media_safety import (
    MediaError,
    MediaNotAllowedError,
    MediaPolicy,
    MediaTooLargeError,
    check_audio,
    check_image,
    check_redirect,
    check_url,
    check_video,
    load_checked,
    read_media_bytes,
)
from support.media_host import MediaHost

OPEN = MediaPolicy(allow_private_networks=True)  # the loopback test server is a private address


def _png(width: int = 8, height: int = 6, fmt: str = "PNG") -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` (a decompression bomb's header; no pixel data)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def _mp4(frames: int = 6, size: int = 32, rate: int = 4) -> bytes:
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = size, size, "yuv420p"
        for value in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), value * 30, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


def _wav(seconds: float) -> bytes:
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(int(16000 * seconds), np.float32), 16000, format="WAV")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def server():
    with MediaHost({"a.png": _png(), "image.png": _png()}, trickle_s=0.2, slow_hop_s=0.6) as host:
        yield host.url


def test_data_urls_and_bytes_are_capped():
    data = _png()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert read_media_bytes(url, MediaPolicy()) == data
    assert read_media_bytes(data, MediaPolicy()) == data
    with pytest.raises(MediaTooLargeError, match="over the cap of 100 .*max_bytes"):
        read_media_bytes(url, MediaPolicy(max_bytes=100))
    with pytest.raises(MediaTooLargeError, match="over the cap"):
        read_media_bytes(data, MediaPolicy(max_bytes=100))
    with pytest.raises(MediaError, match="not valid base64"):
        read_media_bytes("data:image/png;base64,@@@", MediaPolicy())


def test_local_files_only_inside_the_allowed_folder(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(_png())
    (tmp_path / "secret.txt").write_bytes(b"secret")
    (allowed / "link.png").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(MediaNotAllowedError, match="local file reads are off.*media_local_dir"):
        read_media_bytes(str(allowed / "a.png"), MediaPolicy())
    policy = MediaPolicy(local_dir=str(allowed))
    assert read_media_bytes(f"file://{allowed / 'a.png'}", policy) == _png()
    for escaping in (allowed / ".." / "secret.txt", allowed / "link.png", "/etc/hostname"):
        with pytest.raises(MediaNotAllowedError, match="outside the folder"):
            read_media_bytes(f"file://{escaping}", policy)
    with pytest.raises(MediaError, match="does not exist"):
        read_media_bytes(str(allowed / "missing.png"), policy)
    with pytest.raises(ValueError, match="local_dir .* is not a folder"):
        MediaPolicy(local_dir=str(tmp_path / "nowhere"))


def test_url_schemes_and_domain_allow_list():
    with pytest.raises(MediaNotAllowedError, match="unsupported scheme"):
        read_media_bytes("ftp://example.com/a.png", MediaPolicy())
    policy = MediaPolicy(allowed_domains=("example.com",))
    check_url("https://example.com/a.png", policy)
    check_url("https://cdn.EXAMPLE.com/a.png", policy)
    for url in ("https://example.org/a.png", "https://badexample.com/a.png", "https://example.com.evil.io/a"):
        with pytest.raises(MediaNotAllowedError, match="not on the allow-list.*media_allowed_domains"):
            check_url(url, policy)
    with pytest.raises(MediaNotAllowedError, match="allow-list \\(none\\)"):
        check_url("https://example.com/a.png", MediaPolicy(allowed_domains=()))


def test_private_addresses_are_refused_unless_allowed(server):
    port = server.rpartition(":")[2]
    for url in (f"{server}/a.png", f"http://localhost:{port}/a.png", f"http://[::1]:{port}/a.png",
                "http://169.254.169.254/latest/meta-data"):
        with pytest.raises(MediaNotAllowedError, match="non-public address .*allow_private_networks"):
            read_media_bytes(url, MediaPolicy())
    with pytest.raises(MediaError, match="not a valid URL"):  # octal spellings of an address are refused too
        read_media_bytes(f"http://0177.0.0.1:{port}/a.png", MediaPolicy())
    assert read_media_bytes(f"{server}/a.png", OPEN) == _png()


def test_redirects_are_checked_and_limited(server):
    policy = MediaPolicy(allow_private_networks=True, allowed_domains=("127.0.0.1",))
    assert read_media_bytes(f"{server}/redirect?to=/a.png", policy) == _png()
    with pytest.raises(MediaNotAllowedError, match="evil.example is not on the allow-list"):
        read_media_bytes(f"{server}/redirect?to=http://evil.example/a.png", policy)
    with pytest.raises(MediaError, match="redirected more than 3 times .*max_redirects"):
        read_media_bytes(f"{server}/redirect", policy)
    with pytest.raises(MediaNotAllowedError, match="redirects to a file: URL; .*only lead to http"):
        read_media_bytes(f"{server}/redirect?to=file:///etc/passwd", policy)


def test_redirect_targets_are_checked_as_first_urls():
    public = "https://images.example.com/a.png"
    assert check_redirect(public, "/b.png", MediaPolicy()) == "https://images.example.com/b.png"
    for target in ("http://10.0.0.1/a.png", "http://[::ffff:127.0.0.1]/a.png", "http://169.254.169.254/"):
        with pytest.raises(MediaNotAllowedError, match="non-public address"):
            check_redirect(public, target, MediaPolicy())
    with pytest.raises(MediaNotAllowedError, match="redirects to a file: URL"):
        check_redirect(public, "file:///etc/passwd", MediaPolicy(local_dir="/"))
    with pytest.raises(MediaNotAllowedError, match="not on the allow-list"):
        check_redirect(public, "https://elsewhere.example.org/", MediaPolicy(allowed_domains=("example.com",)))


@pytest.mark.parametrize("route, stage", [
    ("trickle-headers", "waiting for the response headers"),
    ("trickle-body", "reading the body"),
    ("slow-redirect?hops=4", "redirected to"),
])
def test_one_deadline_covers_every_step_and_redirect(server, route, stage):
    policy = MediaPolicy(timeout_s=1.5, allow_private_networks=True)
    started = time.monotonic()
    with pytest.raises(MediaError, match="longer than 1.5 s .*media_timeout_s") as refused:
        read_media_bytes(f"{server}/{route}", policy)
    assert time.monotonic() - started < 1.5 + 1.0
    assert stage in str(refused.value)


def test_http_errors_and_byte_caps(server):
    with pytest.raises(MediaError, match="HTTP 404"):
        read_media_bytes(f"{server}/missing", OPEN)
    with pytest.raises(MediaTooLargeError, match="over the cap of 1000"):  # declared in Content-Length
        read_media_bytes(f"{server}/big", MediaPolicy(max_bytes=1000, allow_private_networks=True))
    with pytest.raises(MediaTooLargeError, match="over the cap of 1000"):  # no Content-Length: counted while read
        read_media_bytes(f"{server}/big_no_length", MediaPolicy(max_bytes=1000, allow_private_networks=True))
    with pytest.raises(MediaError, match="could not be resolved"):
        read_media_bytes("http://no-such-host.invalid/a.png", OPEN)


def test_image_checks_format_and_pixels_from_the_header():
    info = check_image(_png(8, 6), MediaPolicy())
    assert (info.format, info.width, info.height) == ("PNG", 8, 6)
    assert check_image(_png(fmt="JPEG"), MediaPolicy()).format == "JPEG"
    with pytest.raises(MediaError, match="accepted format"):
        check_image(_png(fmt="TIFF"), MediaPolicy())  # a format PIL reads but the policy does not accept
    with pytest.raises(MediaError, match="accepted format"):
        check_image(b"%!PS-Adobe-3.0 EPSF-3.0\n", MediaPolicy())
    with pytest.raises(MediaTooLargeError, match="8x6 = 48 pixels, over the cap of 40 .*max_image_pixels"):
        check_image(_png(8, 6), MediaPolicy(max_image_pixels=40))
    for side in (10_000, 100_000):  # over our cap; over PIL's own bomb limit
        with pytest.raises(MediaTooLargeError):
            check_image(_png_header_only(side, side), MediaPolicy())


def test_video_checks_stream_size_frames_and_duration():
    clip = _mp4(frames=6, size=32, rate=4)
    info = check_video(clip, MediaPolicy())
    assert (info.width, info.height) == (32, 32) and info.duration_s == pytest.approx(1.5, abs=0.3)
    with pytest.raises(MediaTooLargeError, match="max_frame_pixels"):
        check_video(clip, MediaPolicy(max_frame_pixels=32 * 31))
    with pytest.raises(MediaTooLargeError, match="max_video_duration_s"):
        check_video(clip, MediaPolicy(max_video_duration_s=1.0))
    if info.frames is not None:
        assert info.frames == 6
        with pytest.raises(MediaTooLargeError, match="max_video_frames"):
            check_video(clip, MediaPolicy(max_video_frames=5))
    with pytest.raises(MediaError, match="not a readable video"):
        check_video(b"not a video at all" * 10, MediaPolicy())


def test_audio_checks_duration():
    assert check_audio(_wav(0.5), MediaPolicy()).duration_s == pytest.approx(0.5)
    with pytest.raises(MediaTooLargeError, match="max_audio_duration_s"):
        check_audio(_wav(0.5), MediaPolicy(max_audio_duration_s=0.25))
    with pytest.raises(MediaError, match="not a readable audio"):
        check_audio(b"RIFF nonsense", MediaPolicy())


def test_load_checked_refuses_media_of_another_kind():
    png_url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    data, info = load_checked(png_url, "image", MediaPolicy())
    assert data == _png() and info.kind == "image"
    with pytest.raises(MediaError, match="a video was expected but the data: URL declares image/png"):
        load_checked(png_url, "video", MediaPolicy())
    with pytest.raises(MediaError, match="not a decodable image"):
        load_checked(_mp4(), "image", MediaPolicy())


def test_policy_validation_and_engine_defaults():
    from exporter.perception.image_preprocess import DEFAULT_MAX_IMAGE_PIXELS
    from exporter.perception.video import VideoLimits

    policy, engine = MediaPolicy(), VideoLimits()
    assert policy.max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS
    assert (policy.max_video_frames, policy.max_video_duration_s, policy.max_frame_pixels) == (
        engine.max_frames, engine.max_duration_s, engine.max_frame_pixels)
    for bad in ({"max_bytes": 0}, {"timeout_s": -1}, {"max_items": True}, {"max_redirects": -1}):
        with pytest.raises(ValueError, match=f"MediaPolicy.{next(iter(bad))}"):
            MediaPolicy(**bad)
    with pytest.raises(ValueError, match="not one string"):
        MediaPolicy(allowed_domains="example.com")
