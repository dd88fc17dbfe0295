"""Fetching and checking untrusted media: one `MediaPolicy` of limits, the fetch helpers, header-level content checks.

Used by the OpenAI-compatible front (server side: strict defaults) and by `query.media` (client side:
`MediaPolicy.client`). A source is bytes, a base64 `data:` URL, an `http(s)://` URL, a `file://` URL or a path.

- URLs: only http(s); every host, the first and each redirect, must be in `allowed_domains` (when set); the
  address actually connected to must not be loopback, private, link-local or reserved unless
  `allow_private_networks` (checked on the open socket, so DNS tricks cannot slip past it); a total time limit;
  a byte cap checked on `Content-Length` and while reading.
- Local paths and `file://` URLs: only inside `local_dir` (symlinks resolved); none when it is unset.
- Content checks read headers only (no full decode): the image format and pixel count (decompression bombs), a
  video's stream, frame size, duration and frame count, an audio clip's duration.

Every failure is a `MediaError` naming the source and the option to change; a cap exceeded is a
`MediaTooLargeError`, a source the policy forbids a `MediaNotAllowedError`.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

MediaBytesSource = str | os.PathLike | bytes
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# The engine's own caps (exporter.perception: DEFAULT_MAX_IMAGE_PIXELS, VideoLimits); tests keep them equal.
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
DEFAULT_MAX_VIDEO_FRAMES = 20_000
DEFAULT_MAX_VIDEO_DURATION_S = 3600.0
DEFAULT_MAX_FRAME_PIXELS = 3840 * 2160
_READ_CHUNK = 64 * 1024


class MediaError(ValueError):
    """Media could not be fetched or is not acceptable; the message names the source and what to change."""


class MediaTooLargeError(MediaError):
    """Media is over one of the policy's size caps (bytes, pixels, frames, duration)."""


class MediaNotAllowedError(MediaError):
    """The policy forbids this source (a host off the allow-list, a private address, a local file)."""


@dataclass(frozen=True)
class MediaPolicy:
    """Limits on fetching and decoding media; the defaults suit a public server.

    `allowed_domains` None allows any host, a tuple only those hosts and their subdomains (an empty tuple: no
    URLs). `local_dir` None forbids local files. Sizes are per media item.
    """

    timeout_s: float = 10.0
    max_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    image_formats: tuple[str, ...] = IMAGE_FORMATS
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES
    max_video_duration_s: float = DEFAULT_MAX_VIDEO_DURATION_S
    max_frame_pixels: int = DEFAULT_MAX_FRAME_PIXELS
    max_audio_duration_s: float = 600.0
    max_items: int = 8
    max_redirects: int = 3
    allowed_domains: tuple[str, ...] | None = None
    allow_private_networks: bool = False
    local_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("timeout_s", "max_bytes", "max_image_pixels", "max_video_frames", "max_video_duration_s",
                     "max_frame_pixels", "max_audio_duration_s", "max_items"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"MediaPolicy.{name} must be a positive number, got {value!r}")
        if isinstance(self.max_redirects, bool) or not isinstance(self.max_redirects, int) or self.max_redirects < 0:
            raise ValueError(f"MediaPolicy.max_redirects must be an integer >= 0, got {self.max_redirects!r}")
        if isinstance(self.allowed_domains, str):
            raise ValueError("MediaPolicy.allowed_domains must be a list of host names, not one string")
        if self.allowed_domains is not None:
            domains = tuple(d.strip().lower().lstrip("*").strip(".") for d in self.allowed_domains)
            object.__setattr__(self, "allowed_domains", tuple(d for d in domains if d))
        object.__setattr__(self, "image_formats", tuple(f.upper() for f in self.image_formats))
        if self.local_dir is not None and not Path(self.local_dir).expanduser().is_dir():
            raise ValueError(f"MediaPolicy.local_dir {self.local_dir} is not a folder; give an existing folder")

    @classmethod
    def client(cls, timeout_s: float, max_bytes: int) -> MediaPolicy:
        """A client's policy: its own files and any host, with a time limit and a byte cap."""
        return cls(timeout_s=timeout_s, max_bytes=max_bytes, allow_private_networks=True, local_dir="/")


def describe_source(source: object) -> str:
    """A short printable name of a media source for error messages."""
    if isinstance(source, (bytes, bytearray)):
        return f"<{len(source)} bytes>"
    text = os.fspath(source) if isinstance(source, os.PathLike) else str(source)
    if text.startswith("data:"):
        return f"data: URL ({text[:40].partition(',')[0]})"
    return text if len(text) <= 80 else text[:60] + "..." + text[-15:]


def _check_size(size: int, policy: MediaPolicy, source: object) -> None:
    if size > policy.max_bytes:
        raise MediaTooLargeError(
            f"media {describe_source(source)} has {size} bytes, over the cap of {policy.max_bytes} "
            "(option max_bytes); send a smaller file or raise max_bytes"
        )


def read_media_bytes(source: MediaBytesSource, policy: MediaPolicy) -> bytes:
    """The bytes of a media file given as bytes, a path, or a `file://`, `http(s)://` or base64 `data:` URL."""
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    elif isinstance(source, str) and source.startswith("data:"):
        data = _decode_data_url(source, policy)
    elif isinstance(source, str) and source.lower().startswith(("http://", "https://")):
        return _fetch_url(source, policy)
    elif isinstance(source, str) and "://" in source[:12] and not source.startswith("file://"):
        raise MediaNotAllowedError(
            f"media URL {describe_source(source)} has an unsupported scheme; use http(s)://, data: or file://"
        )
    elif isinstance(source, (str, os.PathLike)):
        data = _read_file(source, policy)
    else:
        raise MediaError(
            f"cannot read media from a {type(source).__name__}; give a path, URL, data: URL or bytes"
        )
    _check_size(len(data), policy, source)
    return data


def data_url_mime(url: str) -> str:
    """The MIME type a `data:` URL declares ("" when it declares none)."""
    return url[len("data:"):].partition(",")[0].split(";")[0].strip().lower()


def _decode_data_url(url: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise MediaError("data: URL has no ',' before its payload; use data:<mime>;base64,<data>")
    # base64 grows data by 4/3: refuse oversized payloads before decoding them.
    _check_size(len(payload) * 3 // 4, policy, "data: URL")
    if header.endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise MediaError(f"data: URL payload is not valid base64 ({error})") from None
    return urllib.parse.unquote_to_bytes(payload)


def _read_file(source: str | os.PathLike, policy: MediaPolicy) -> bytes:
    text = os.fspath(source)
    path = Path(urllib.parse.unquote(text[len("file://"):]) if text.startswith("file://") else text).expanduser()
    if policy.local_dir is None:
        raise MediaNotAllowedError(
            f"media {describe_source(source)} is a local file, and local file reads are off; send the file's "
            "bytes (a data: URL) or allow a folder with the media_local_dir option"
        )
    root = Path(policy.local_dir).expanduser().resolve()
    resolved = path.resolve()
    if not resolved.is_relative_to(root):
        raise MediaNotAllowedError(
            f"media file {path} is outside the folder local files may be read from ({root}, option media_local_dir)"
        )
    if not resolved.is_file():
        raise MediaError(f"media file {path} does not exist (or is not a file); check the path")
    _check_size(resolved.stat().st_size, policy, path)
    with resolved.open("rb") as file:
        data = file.read(policy.max_bytes + 1)
    _check_size(len(data), policy, path)
    return data


# --- URLs ---------------------------------------------------------------------------------------------------------

def check_url(url: str, policy: MediaPolicy) -> None:
    """MediaNotAllowedError unless `url` is http(s) with a host the policy allows (addresses are checked on connect)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise MediaNotAllowedError(f"media URL {describe_source(url)} is not http(s); only http(s) URLs are fetched")
    host = (parts.hostname or "").lower().rstrip(".")
    if not host:
        raise MediaError(f"media URL {describe_source(url)} has no host")
    if policy.allowed_domains is not None and not any(
        host == domain or host.endswith("." + domain) for domain in policy.allowed_domains
    ):
        allowed = ", ".join(policy.allowed_domains) or "none"
        raise MediaNotAllowedError(
            f"media host {host} is not on the allow-list ({allowed}); add it with the media_allowed_domains option"
        )


def _check_peer(sock, host: str, policy: MediaPolicy) -> None:
    if policy.allow_private_networks:
        return
    address = ipaddress.ip_address(sock.getpeername()[0].split("%")[0])
    if getattr(address, "ipv4_mapped", None):
        address = address.ipv4_mapped
    if not address.is_global or address.is_multicast:
        sock.close()
        raise MediaNotAllowedError(
            f"media host {host} is at the non-public address {address}; fetching from private networks is off "
            "(option media_allow_private_networks)"
        )


def _opener(policy: MediaPolicy) -> urllib.request.OpenerDirector:
    """urllib with every connection's peer address checked and every redirect target checked."""

    class CheckedHTTPConnection(http.client.HTTPConnection):
        def connect(self):
            super().connect()
            _check_peer(self.sock, self.host, policy)

    class CheckedHTTPSConnection(http.client.HTTPSConnection):
        def connect(self):
            super().connect()
            _check_peer(self.sock, self.host, policy)

    class HTTPHandler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(CheckedHTTPConnection, req)

    class HTTPSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(CheckedHTTPSConnection, req, context=self._context)

    class RedirectHandler(urllib.request.HTTPRedirectHandler):
        max_redirections = policy.max_redirects

        def redirect_request(self, req, fp, code, msg, headers, newurl):
            check_url(newurl, policy)
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    return urllib.request.build_opener(HTTPHandler, HTTPSHandler, RedirectHandler)


def _fetch_url(url: str, policy: MediaPolicy) -> bytes:
    check_url(url, policy)
    deadline = time.monotonic() + policy.timeout_s
    timeout_hint = (
        f"fetching {describe_source(url)} took longer than {policy.timeout_s:g} s (option media_timeout_s); "
        "use a faster host or send the file's bytes"
    )
    try:
        with _opener(policy).open(url, timeout=policy.timeout_s) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit():
                _check_size(int(length), policy, url)
            chunks, size = [], 0
            while chunk := response.read1(_READ_CHUNK):
                chunks.append(chunk)
                size += len(chunk)
                _check_size(size, policy, url)
                if time.monotonic() > deadline:
                    raise MediaError(timeout_hint)
            return b"".join(chunks)
    except urllib.error.HTTPError as error:
        if 300 <= error.code < 400:
            raise MediaError(f"fetching {describe_source(url)} took more than {policy.max_redirects} redirects "
                             "(option max_redirects)") from None
        raise MediaError(f"fetching {describe_source(url)} failed: HTTP {error.code} {error.reason}") from None
    except urllib.error.URLError as error:
        if isinstance(error.reason, TimeoutError):
            raise MediaError(timeout_hint) from None
        raise MediaError(f"fetching {describe_source(url)} failed: {error.reason}") from None
    except TimeoutError:
        raise MediaError(timeout_hint) from None
    except (http.client.HTTPException, ConnectionError) as error:
        raise MediaError(f"fetching {describe_source(url)} failed: {type(error).__name__} {error}") from None


# --- content checks (headers only) --------------------------------------------------------------------------------

@dataclass(frozen=True)
class MediaInfo:
    """What a content check learned: the container format and, where known, size, duration and frame count."""

    kind: str
    format: str
    width: int = 0
    height: int = 0
    duration_s: float | None = None
    frames: int | None = None


def check_image(data: bytes, policy: MediaPolicy, name: str = "image") -> MediaInfo:
    """The image's format and size from its header; MediaError unless an allowed format within the pixel cap."""
    try:
        with Image.open(io.BytesIO(data), formats=list(policy.image_formats)) as image:
            width, height, fmt = image.width, image.height, image.format
    except Image.DecompressionBombError as error:
        raise MediaTooLargeError(f"{name} is too large to decode ({error}); option max_image_pixels") from None
    except (UnidentifiedImageError, OSError, ValueError) as error:
        reason = "unknown or refused format" if isinstance(error, UnidentifiedImageError) else str(error)
        raise MediaError(
            f"{name} is not a decodable image of an accepted format ({', '.join(policy.image_formats)}): {reason}"
        ) from None
    if width * height > policy.max_image_pixels:
        raise MediaTooLargeError(
            f"{name} has {width}x{height} = {width * height} pixels, over the cap of {policy.max_image_pixels} "
            "(option max_image_pixels); downscale it"
        )
    return MediaInfo("image", fmt, width, height)


def check_video(data: bytes, policy: MediaPolicy, name: str = "video") -> MediaInfo:
    """The video's stream facts from its container header; MediaError unless within the frame, pixel and time caps."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise MediaError(f"{name} has no video stream (format {container.format.name}); send a video file")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            duration = container.duration / av.time_base if container.duration else None
            if duration is None and stream.duration and stream.time_base:
                duration = float(stream.duration * stream.time_base)
            frames, fmt = int(stream.frames or 0) or None, container.format.name
    except (av.error.FFmpegError, OSError, ValueError, IndexError) as error:
        if isinstance(error, MediaError):
            raise
        raise MediaError(f"{name} is not a readable video file: {getattr(error, 'strerror', None) or error}") from None
    if width * height > policy.max_frame_pixels:
        raise MediaTooLargeError(f"{name} has {width}x{height} pixels per frame, over the cap of "
                                 f"{policy.max_frame_pixels} (option max_frame_pixels); downscale it")
    if duration is not None and duration > policy.max_video_duration_s:
        raise MediaTooLargeError(f"{name} lasts {duration:.1f} s, over the cap of {policy.max_video_duration_s:g} s "
                                 "(option max_video_duration_s); send a shorter clip")
    if frames is not None and frames > policy.max_video_frames:
        raise MediaTooLargeError(f"{name} has {frames} frames, over the cap of {policy.max_video_frames} "
                                 "(option max_video_frames); send a shorter clip")
    return MediaInfo("video", fmt, width, height, duration, frames)


def check_audio(data: bytes, policy: MediaPolicy, name: str = "audio") -> MediaInfo:
    """The clip's format and duration from its header; MediaError unless readable and within the duration cap."""
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(data))
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as error:
        raise MediaError(f"{name} is not a readable audio file (wav, flac, ogg, mp3): {error}") from None
    if info.duration > policy.max_audio_duration_s:
        raise MediaTooLargeError(f"{name} lasts {info.duration:.1f} s, over the cap of "
                                 f"{policy.max_audio_duration_s:g} s (option max_audio_duration_s)")
    return MediaInfo("audio", info.format, duration_s=float(info.duration), frames=int(info.frames))


CONTENT_CHECKS = {"image": check_image, "video": check_video, "audio": check_audio}


def load_checked(source: MediaBytesSource, kind: str, policy: MediaPolicy) -> tuple[bytes, MediaInfo]:
    """Fetch a media item with the policy and check that it is a `kind` ("image", "video", "audio") within the caps.

    A `data:` URL declaring another kind of media (`data:video/mp4` sent as an image) is refused.
    """
    if kind not in CONTENT_CHECKS:
        raise ValueError(f"unknown media kind {kind!r}; choose one of {', '.join(CONTENT_CHECKS)}")
    if isinstance(source, str) and source.startswith("data:"):
        family = data_url_mime(source).partition("/")[0]
        if family in CONTENT_CHECKS and family != kind:
            raise MediaError(f"a {kind} was expected but the data: URL declares {data_url_mime(source)}")
    data = read_media_bytes(source, policy)
    return data, CONTENT_CHECKS[kind](data, policy, f"{kind} {describe_source(source)}")
