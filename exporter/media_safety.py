"""Fetching and checking untrusted media: one `MediaPolicy` of limits, the fetch helpers, header-level content checks.

Used by the OpenAI-compatible front (server side: strict defaults; `MediaFetcher` on its event loop) and by
`query.media` (client side: `MediaPolicy.client`, the same fetcher run synchronously). A source is bytes, a base64
`data:` URL, an `http(s)://` URL, a `file://` URL or a path.

- URLs: only http(s); every host, the first and each redirect, must be in `allowed_domains` (when set); a host must
  not lead to a loopback, private, link-local or reserved address unless `allow_private_networks` (checked on the
  addresses the connection is made to, so DNS tricks cannot slip past it); a redirect may only lead to another
  http(s) URL. One deadline per URL covers every step and every redirect; a byte cap is checked on
  `Content-Length` and while reading.
- Local paths and `file://` URLs: only inside `local_dir` (symlinks resolved); none when it is unset.
- Content checks read headers only (no full decode): the image format and pixel count (decompression bombs), a
  video's stream, frame size, duration and frame count, an audio clip's duration.

Every failure is a `MediaError` naming the source, the reason and the option to change; a cap exceeded is a
`MediaTooLargeError`, a source the policy forbids a `MediaNotAllowedError`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import io
import ipaddress
import os
import socket
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import aiohttp.abc
import aiohttp.resolver
from PIL import Image, UnidentifiedImageError

MediaBytesSource = str | os.PathLike | bytes
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# The engine's own caps (exporter.perception: DEFAULT_MAX_IMAGE_PIXELS, VideoLimits); tests keep them equal.
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
DEFAULT_MAX_VIDEO_FRAMES = 20_000
DEFAULT_MAX_VIDEO_DURATION_S = 3600.0
DEFAULT_MAX_FRAME_PIXELS = 3840 * 2160
_READ_CHUNK = 64 * 1024
USER_AGENT = "nemo-mm-deploy"


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
    URLs). `local_dir` None forbids local files. Sizes are per media item, but `max_request_bytes`, the media bytes of
    one request together. `timeout_s` is one deadline per URL
    (redirects included); `max_fetches` and `max_fetches_per_host` bound the URLs one `MediaFetcher` fetches at once.
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
    max_request_bytes: int = 32 * 1024 * 1024
    max_redirects: int = 3
    max_fetches: int = 128
    max_fetches_per_host: int = 16
    allowed_domains: tuple[str, ...] | None = None
    allow_private_networks: bool = False
    local_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("timeout_s", "max_bytes", "max_image_pixels", "max_video_frames", "max_video_duration_s",
                     "max_frame_pixels", "max_audio_duration_s", "max_items", "max_request_bytes", "max_fetches",
                     "max_fetches_per_host"):
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
    elif _is_http_url(source):
        return fetch_url(source, policy)
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
    return _checked_bytes(data, policy, source)


def _checked_bytes(data: bytes, policy: MediaPolicy, source: object) -> bytes:
    """`data`, unless it is empty or over the byte cap."""
    _check_size(len(data), policy, source)
    if not data:
        raise MediaError(f"media {describe_source(source)} is empty (0 bytes); send a non-empty file")
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
            f"media file {path} is outside the folder local files may be read from (option media_local_dir)"
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
    """MediaNotAllowedError unless `url` is http(s) with a host the policy allows (names are checked on resolving)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower().rstrip(".")
    except ValueError:  # an unbalanced IPv6 bracket, a bad port
        raise MediaError(f"media URL {describe_source(url)} is not a valid URL") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise MediaNotAllowedError(f"media URL {describe_source(url)} is not http(s); only http(s) URLs are fetched")
    if not host:
        raise MediaError(f"media URL {describe_source(url)} has no host")
    if policy.allowed_domains is not None and not any(
        host == domain or host.endswith("." + domain) for domain in policy.allowed_domains
    ):
        allowed = ", ".join(policy.allowed_domains) or "none"
        raise MediaNotAllowedError(
            f"media host {host} is not on the allow-list ({allowed}); add it with the media_allowed_domains option"
        )
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        return  # a name: its addresses are checked when it is resolved
    _check_public(str(literal), host, policy)


def _check_public(address: str, host: str, policy: MediaPolicy) -> None:
    """MediaNotAllowedError when `address` (what `host` leads to) is not public and private networks are off."""
    if policy.allow_private_networks:
        return
    ip = ipaddress.ip_address(address.split("%")[0])
    if getattr(ip, "ipv4_mapped", None):
        ip = ip.ipv4_mapped
    if not ip.is_global or ip.is_multicast:
        raise MediaNotAllowedError(
            f"media host {host} is at the non-public address {ip}; fetching from private networks is off "
            "(option media_allow_private_networks)"
        )


class _PublicResolver(aiohttp.abc.AbstractResolver):
    """aiohttp's resolver that refuses a name leading to any non-public address: the connection can only go to the
    addresses it returns, so a name cannot point elsewhere between the check and the connect."""

    def __init__(self, policy: MediaPolicy):
        self.policy = policy
        self._resolver = aiohttp.resolver.DefaultResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list:
        addresses = await self._resolver.resolve(host, port, family)
        for address in addresses:
            _check_public(address["host"], host, self.policy)
        return addresses

    async def close(self) -> None:
        await self._resolver.close()


@dataclass
class _Progress:
    """How far one fetch got, for the message when its deadline passes."""

    first_url: str
    url: str = ""
    stage: str = "waiting for a free fetch slot"
    received: int = 0

    def timeout_error(self, policy: MediaPolicy) -> MediaError:
        via = f" (redirected to {describe_source(self.url)})" if self.url != self.first_url else ""
        stage = f"{self.stage} ({self.received} bytes in)" if self.stage == "reading the body" else self.stage
        return MediaError(
            f"fetching {describe_source(self.first_url)}{via} took longer than {policy.timeout_s:g} s (option "
            f"media_timeout_s); it stopped while {stage}; use a faster host or send the file's bytes"
        )


async def _connected(_session, context, _params) -> None:
    """aiohttp trace hook: the connection is open (new or reused), the request goes out."""
    context.trace_request_ctx.stage = "waiting for the response headers"


_TRACE = aiohttp.TraceConfig()
_TRACE.on_connection_create_end.append(_connected)
_TRACE.on_connection_reuseconn.append(_connected)


class MediaFetcher:
    """Fetches http(s) media URLs under one policy, from one event loop, without threads.

    Each URL has one deadline, `policy.timeout_s`, covering the wait for a fetch slot, name resolution, connecting,
    the headers, the body and every redirect. At most `policy.max_fetches` URLs are fetched at once, and at most
    `policy.max_fetches_per_host` from one host, so a slow host cannot take every slot. Every redirect target is
    checked as the first URL was. `aclose()` releases the connections.
    """

    def __init__(self, policy: MediaPolicy):
        self.policy = policy
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        self._hosts: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}

    async def fetch(self, url: str) -> bytes:
        """The body of `url`; MediaError naming the reason when it is refused, fails or misses its deadline."""
        check_url(url, self.policy)
        progress = _Progress(url, url)
        try:
            return await asyncio.wait_for(self._fetch(progress), self.policy.timeout_s)
        except asyncio.TimeoutError:
            raise progress.timeout_error(self.policy) from None
        except aiohttp.ClientError as error:
            raise _client_error(error, progress.url) from None

    async def read(self, source: MediaBytesSource) -> bytes:
        """`read_media_bytes` for any source, with URLs fetched here and the rest read in a worker thread."""
        if _is_http_url(source):
            return await self.fetch(source)
        return await asyncio.to_thread(read_media_bytes, source, self.policy)

    async def load_checked(self, source: MediaBytesSource, kind: str) -> tuple[bytes, MediaInfo]:
        """`load_checked` with URLs fetched here and the content check in a worker thread."""
        _check_declared_kind(source, kind)
        data = await self.read(source)
        return data, await asyncio.to_thread(CONTENT_CHECKS[kind], data, self.policy, _item_name(kind, source))

    async def aclose(self) -> None:
        """Close the connections (the fetcher opens new ones if used again)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _fetch(self, progress: _Progress) -> bytes:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.policy.max_fetches)
        progress.stage = f"waiting for a free fetch slot (at most {self.policy.max_fetches} at once)"
        async with self._slots:
            for _ in range(self.policy.max_redirects + 1):
                host = urllib.parse.urlsplit(progress.url).hostname or ""
                progress.stage = (f"waiting for a free slot for host {host} (at most "
                                  f"{self.policy.max_fetches_per_host} fetches from one host at once)")
                async with self._host_slot(host):
                    progress.stage = f"resolving and connecting to {host}"
                    async with self._client().get(progress.url, allow_redirects=False,
                                                  trace_request_ctx=progress) as response:
                        target = _redirect_target(progress.url, response, self.policy)
                        if target is None:
                            return await _read_body(response, progress, self.policy)
                progress.url = target
        raise MediaError(f"fetching {describe_source(progress.first_url)} was redirected more than "
                         f"{self.policy.max_redirects} times (option max_redirects)")

    @contextlib.asynccontextmanager
    async def _host_slot(self, host: str) -> AsyncIterator[None]:
        slot, users = self._hosts.setdefault(host, (asyncio.Semaphore(self.policy.max_fetches_per_host), [0]))
        users[0] += 1
        try:
            async with slot:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._hosts[host]

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            resolver = None if self.policy.allow_private_networks else _PublicResolver(self.policy)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, resolver=resolver),
                timeout=aiohttp.ClientTimeout(total=None),
                auto_decompress=False,  # bytes are capped as sent: no compressed bombs
                headers={"Accept-Encoding": "identity", "User-Agent": USER_AGENT},
                # Proxies only where the address checks are off: through a proxy they would check the proxy.
                trust_env=self.policy.allow_private_networks,
                trace_configs=[_TRACE],
            )
        return self._session


def _is_http_url(source: object) -> bool:
    return isinstance(source, str) and source.lower().startswith(("http://", "https://"))


def _redirect_target(url: str, response: aiohttp.ClientResponse, policy: MediaPolicy) -> str | None:
    """The URL a redirect leads to (checked), None for a success; MediaError for other statuses."""
    if response.status in (301, 302, 303, 307, 308):
        location = response.headers.get("Location")
        if not location:
            raise MediaError(f"fetching {describe_source(url)} failed: HTTP {response.status} without a Location")
        return check_redirect(url, location, policy)
    if not 200 <= response.status < 300:
        raise MediaError(f"fetching {describe_source(url)} failed: HTTP {response.status} {response.reason or ''}"
                         .rstrip())
    return None


def check_redirect(url: str, location: str, policy: MediaPolicy) -> str:
    """The URL a redirect from `url` to `location` leads to, checked as a first URL is; only http(s) targets."""
    try:
        target = urllib.parse.urljoin(url, location)
    except ValueError:
        raise MediaError(f"media URL {describe_source(url)} redirects to an invalid URL") from None
    scheme = target.partition(":")[0].lower()
    if scheme not in ("http", "https"):
        raise MediaNotAllowedError(f"media URL {describe_source(url)} redirects to a {scheme}: URL; redirects "
                                   "may only lead to http(s) URLs")
    check_url(target, policy)
    return target


async def _read_body(response: aiohttp.ClientResponse, progress: _Progress, policy: MediaPolicy) -> bytes:
    """The body, refused as soon as its declared or received size is over the byte cap."""
    if response.content_length is not None:
        _check_size(response.content_length, policy, progress.url)
    progress.stage, chunks = "reading the body", []
    async for chunk in response.content.iter_chunked(_READ_CHUNK):
        progress.received += len(chunk)
        _check_size(progress.received, policy, progress.url)
        chunks.append(chunk)
    return _checked_bytes(b"".join(chunks), policy, progress.url)


def _client_error(error: aiohttp.ClientError, url: str) -> MediaError:
    """A MediaError naming why the HTTP client failed (DNS, connect, TLS, a broken response)."""
    where = describe_source(url)
    if isinstance(error, aiohttp.InvalidURL):
        return MediaError(f"media URL {where} is not a valid URL")
    if isinstance(error, aiohttp.ClientSSLError):
        return MediaError(f"fetching {where} failed: TLS error ({error.os_error})")
    if isinstance(error, aiohttp.ClientConnectorError):
        if isinstance(error.os_error, socket.gaierror):
            return MediaError(f"fetching {where} failed: the host {error.host} could not be resolved")
        reason = os.strerror(error.os_error.errno) if error.os_error.errno else error.os_error
        return MediaError(f"fetching {where} failed: cannot connect to {error.host}:{error.port} ({reason})")
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return MediaError(f"fetching {where} failed: the server closed the connection")
    return MediaError(f"fetching {where} failed: {type(error).__name__} {error}".rstrip())


def fetch_url(url: str, policy: MediaPolicy) -> bytes:
    """`MediaFetcher(policy).fetch(url)` for synchronous callers (in a worker thread if an event loop runs here)."""
    async def fetch_once() -> bytes:
        fetcher = MediaFetcher(policy)
        try:
            return await fetcher.fetch(url)
        finally:
            await fetcher.aclose()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(fetch_once())
    with concurrent.futures.ThreadPoolExecutor(1) as worker:
        return worker.submit(asyncio.run, fetch_once()).result()


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


def _check_declared_kind(source: MediaBytesSource, kind: str) -> None:
    """ValueError for an unknown kind; MediaError for a `data:` URL declaring another kind (`data:video/mp4` as an
    image)."""
    if kind not in CONTENT_CHECKS:
        raise ValueError(f"unknown media kind {kind!r}; choose one of {', '.join(CONTENT_CHECKS)}")
    if isinstance(source, str) and source.startswith("data:"):
        family = data_url_mime(source).partition("/")[0]
        if family in CONTENT_CHECKS and family != kind:
            raise MediaError(f"a {kind} was expected but the data: URL declares {data_url_mime(source)}")


def load_checked(source: MediaBytesSource, kind: str, policy: MediaPolicy) -> tuple[bytes, MediaInfo]:
    """Fetch a media item with the policy and check that it is a `kind` ("image", "video", "audio") within the caps.

    A `data:` URL declaring another kind of media is refused. `MediaFetcher.load_checked` does the same on an
    event loop.
    """
    _check_declared_kind(source, kind)
    data = read_media_bytes(source, policy)
    return data, CONTENT_CHECKS[kind](data, policy, _item_name(kind, source))


def _item_name(kind: str, source: MediaBytesSource) -> str:
    return f"{kind} {describe_source(source)}"
