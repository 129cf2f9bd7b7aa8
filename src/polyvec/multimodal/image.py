"""Images in: decoded and checked with Pillow, turned into the pixel patches a vision tower reads.

Accepted forms: a `PIL.Image.Image`, encoded bytes, base64 `data:` URLs (`data:image/png;base64,...`), and
http(s) URLs on hosts the deployment allows (none by default: a server fetching what a client names is a risk).
Every refusal is an `ImageError` naming the image's position and what is wrong: not an image, truncated, a
decompression bomb, more pixels than the limit, an aspect ratio the resize rule cannot keep.

`qwen2_vl_patches` is the Qwen2-VL / Qwen2.5-VL / ColQwen2 processor's rule (transformers'
`Qwen2VLImageProcessor`): resize (bicubic) so both sides are multiples of patch × merge and the pixel count is
within [min_pixels, max_pixels], scale to [0, 1], normalize with CLIP's mean and std, and cut into patches of
`temporal_patch_size` frames (the image repeated) × patch × patch, ordered so each merge × merge group of patches
is contiguous. Pillow is the `vision` extra (`pip install 'polyvec[vision]'`).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import math
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_IMAGE_PIXELS = 50_000_000  # decoded size above which an image is refused (Pillow's bomb check, made an error)
FETCH_MAX_BYTES = 64 * 1024 * 1024  # an allowed remote image larger than this is refused, not read on
FETCH_TIMEOUT = 10.0  # seconds to connect and between reads of a remote image
FETCH_DEADLINE = 30.0  # seconds for the whole download: a host that trickles bytes is cut off
# Pillow formats decoded here (vLLM's list): still images Pillow decodes in-process. Left out: EPS (Pillow runs
# Ghostscript on the PostScript), WMF, and the stub formats that need external handlers (BUFR, GRIB, HDF5, MPEG).
IMAGE_FORMATS = (
    "AVIF", "BLP", "BMP", "CUR", "DCX", "DDS", "DIB", "FITS", "FLI", "FTEX", "GBR", "GIF", "ICNS", "ICO", "IM", "IMT",
    "IPTC", "JPEG", "JPEG2000", "MCIDAS", "MSP", "PCD", "PCX", "PIXAR", "PNG", "PPM", "PSD", "QOI", "SGI", "SPIDER",
    "SUN", "TGA", "TIFF", "WEBP", "XBM", "XPM", "XVTHUMB",
)  # fmt: skip
HIGH_BIT_MODES = ("I", "F")  # 32-bit int, float and the 16-bit "I;16*" modes: Pillow's RGB conversion clips them


class ImageError(ValueError):
    """A bad image, with its position in the request."""

    def __init__(self, index: int, detail: str):
        super().__init__(f"image {index}: {detail}")
        self.index = index


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as e:  # an optional extra: the core install stays light
        raise ImportError("image inputs need Pillow: pip install 'polyvec[vision]'") from e
    return Image


def _check_host(url: str, index: int, allowed_domains: tuple[str, ...]) -> None:
    """ImageError unless `url` is http(s) on an allowed host (or a subdomain of one)."""
    parts = urllib.parse.urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme.lower() not in ("http", "https") or not any(
        host == d or host.endswith("." + d) for d in allowed_domains
    ):
        allowed = ", ".join(allowed_domains) if allowed_domains else "none"
        raise ImageError(
            index,
            f"remote image URLs are fetched only from --allowed-media-domains (allowed: {allowed}); "
            f"{host or url[:40]!r} is not one of them; send the image as a base64 data: URL",
        )


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host: otherwise an allowed one could send the server anywhere."""

    def __init__(self, index: int, allowed_domains: tuple[str, ...]):
        self.index, self.allowed_domains = index, allowed_domains

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        _check_host(newurl, self.index, self.allowed_domains)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def is_image_object(value: Any) -> bool:
    """A PIL image or an encoded image's bytes (checked without importing Pillow): one prompt, never a list."""
    return isinstance(value, (bytes, bytearray, memoryview)) or type(value).__module__.startswith("PIL.")


def is_image_prompt(value: Any) -> bool:
    """A prompt that is one image: a PIL image, an encoded image's bytes or a base64 data:image URL (the scheme
    in any case, as URLs allow)."""
    if isinstance(value, str):
        return value[:11].lower() == "data:image/"
    return is_image_object(value)


def is_remote(source: Any) -> bool:
    """An http(s) URL, which `load_image` downloads (a caller may keep that off threads that must stay free)."""
    return isinstance(source, str) and source[:8].lower().startswith(("http://", "https://"))


def fetch_image(
    url: str,
    index: int,
    allowed_domains: tuple[str, ...],
    max_bytes: int,
    timeout: float,
    deadline: float = FETCH_DEADLINE,
) -> bytes:
    """An http(s) image URL's bytes, only from an allowed host (redirects included), within `max_bytes` and
    `deadline` seconds in all (`timeout`: to connect and between reads); ImageError otherwise."""
    _check_host(url, index, allowed_domains)
    opener = urllib.request.build_opener(_CheckedRedirects(index, allowed_domains))
    end = time.monotonic() + deadline
    chunks: list[bytes] = []
    size = 0
    try:
        with opener.open(url, timeout=timeout) as response:
            while size <= max_bytes:
                if time.monotonic() > end:
                    raise ImageError(index, f"fetching {url[:200]} took more than {deadline:g} s")
                chunk = response.read1(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except ImageError:
        raise
    except (OSError, ValueError) as e:  # URLError, HTTPError, timeouts
        raise ImageError(index, f"fetching {url[:200]} failed ({type(e).__name__}: {e})") from None
    if size > max_bytes:
        raise ImageError(index, f"the image at {url[:200]} is over {max_bytes} bytes")
    return b"".join(chunks)


def load_image(
    source: Any,
    index: int = 0,
    max_pixels: int = MAX_IMAGE_PIXELS,
    *,
    allowed_domains: tuple[str, ...] = (),
    before_decode: Callable[[int, int], None] | None = None,
    transparent_on_white: bool = True,
) -> Any:
    """A PIL image in RGB from a PIL image, encoded bytes, a base64 data: URL or an http(s) URL on an allowed
    host; ImageError if it is not one. `before_decode(width, height)` may refuse the image (by raising) once its
    header is read, before its pixels are decoded. Transparent pixels go on white (transformers' convert_to_rgb,
    vLLM), or with `transparent_on_white` false keep the colour they hide (PIL's convert("RGB"), colpali-engine's)."""
    Image = _pil()
    import PIL.ImageOps

    if isinstance(source, Image.Image):
        image = source
        if before_decode is not None:
            before_decode(image.width, image.height)
        try:
            image.load()  # a lazily opened file is decoded here: a truncated or closed one fails with its index
        except Exception as e:
            raise ImageError(
                index, f"not a readable image ({type(e).__name__}: {str(e) or 'its file is closed'})"
            ) from None
    else:
        if isinstance(source, str):
            if is_remote(source):
                source = fetch_image(source, index, allowed_domains, FETCH_MAX_BYTES, FETCH_TIMEOUT)
            elif not source[:5].lower() == "data:":
                raise ImageError(index, "a string image must be a base64 data: URL (data:image/png;base64,...)")
            else:
                header, _, payload = source.partition(",")
                if not header.lower().endswith(";base64"):
                    raise ImageError(index, "the data: URL is not base64-encoded")
                try:
                    source = base64.b64decode(payload, validate=True)
                except (binascii.Error, ValueError):
                    raise ImageError(index, "the data: URL's base64 payload does not decode") from None
        if isinstance(source, memoryview):
            source = source.tobytes()
        if not isinstance(source, (bytes, bytearray)):
            raise ImageError(index, f"expected a PIL image, bytes or a data: URL, got {type(source).__name__}")
        if Image.MAX_IMAGE_PIXELS is not None and max_pixels > Image.MAX_IMAGE_PIXELS:
            # Pillow's own bomb check (process-wide) would refuse what the configured limit allows
            Image.MAX_IMAGE_PIXELS = max_pixels
        try:
            with warnings.catch_warnings():
                # the limit is the check below, on the header before any pixel is decoded; Pillow's error at
                # twice its own limit stays as the bomb guard for what is far beyond
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(source), formats=IMAGE_FORMATS)
                if image.width * image.height > max_pixels:
                    raise ImageError(index, f"{image.width}x{image.height} pixels, more than the limit of {max_pixels}")
                if before_decode is not None:
                    before_decode(image.width, image.height)
                with contextlib.suppress(Exception):  # as vLLM: a broken orientation tag leaves the image as it is
                    image = PIL.ImageOps.exif_transpose(image)  # pixels as the page is displayed (phone photos, scans)
                image.load()  # decode now: a truncated file fails here, not later
        except ImageError:
            raise
        except Image.DecompressionBombError:
            raise ImageError(index, "a decompression bomb (its decoded size is far beyond the pixel limit)") from None
        except Image.UnidentifiedImageError:
            raise ImageError(index, "not a readable image (none of the accepted image formats)") from None
        except Exception as e:  # OSError for truncated data, ...
            raise ImageError(index, f"not a readable image ({type(e).__name__}: {e})") from None
    if image.width * image.height > max_pixels:
        raise ImageError(index, f"{image.width}x{image.height} pixels, more than the limit of {max_pixels}")
    if image.width < 1 or image.height < 1:
        raise ImageError(index, "the image is empty")
    if image.mode.startswith(HIGH_BIT_MODES):
        raise ImageError(
            index, f"mode {image.mode} (16-bit or more per channel) is not supported: convert it to 8-bit RGB or L"
        )
    if image.mode == "RGB":
        return image
    try:
        rgba = image.convert("RGBA" if transparent_on_white else "RGB")
    except ValueError as e:  # a mode Pillow cannot turn into RGB
        raise ImageError(index, f"mode {image.mode} cannot be converted to RGB ({e})") from None
    if not transparent_on_white:
        return rgba
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's size rule: both sides multiples of `factor`, pixels within [min_pixels, max_pixels], the aspect
    ratio kept as well as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f}:1 is over the limit of 200:1")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class Qwen2VLPixels:
    """One image as a Qwen2-VL (or SigLIP) vision tower reads it."""

    data: torch.Tensor | np.ndarray
    """The patches [grid_h * grid_w, 3 * temporal * patch * patch] float32, or Qwen2-VL's resized image [h, w, 3]
    uint8 with `recipe`: made into patches when its batch is built (a queued page then holds its bytes, not
    float32 patches of two frames)."""
    grid_thw: tuple[int, int, int]  # (1, grid_h, grid_w) in patches
    recipe: tuple[tuple[float, ...], tuple[float, ...], int, int, int] | None = None
    """For a uint8 image: (mean, std, patch size, merge size, temporal patch size)."""

    @property
    def patches(self) -> torch.Tensor:
        if self.recipe is None:
            assert isinstance(self.data, torch.Tensor)
            return self.data
        assert isinstance(self.data, np.ndarray)
        return torch.from_numpy(_qwen2_vl_layout(self.data, *self.recipe))

    @property
    def num_patches(self) -> int:
        return self.grid_thw[1] * self.grid_thw[2]


def _qwen2_vl_layout(
    image: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...], p: int, m: int, temporal: int
) -> np.ndarray:
    """A resized image [h, w, 3] uint8 → its normalized patches, in the order the processor writes them."""
    h, w = image.shape[:2]
    x = image.astype(np.float32).transpose(2, 0, 1) * np.float32(1 / 255)  # [3, h, w]
    x = (x - np.asarray(mean, np.float32)[:, None, None]) / np.asarray(std, np.float32)[:, None, None]
    gh, gw = h // p, w // p
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, 3, p, p]
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, p, p))  # frames: the image twice
    return np.ascontiguousarray(x).reshape(gh * gw, 3 * temporal * p * p)


def qwen2_vl_patches(
    image: Any,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
    patch_size: int = 14,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    mean: tuple[float, float, float] = CLIP_MEAN,
    std: tuple[float, float, float] = CLIP_STD,
    index: int = 0,
) -> Qwen2VLPixels:
    """A PIL image (RGB) → its normalized patches, in the order the processor writes them."""
    Image = _pil()
    try:
        h, w = smart_resize(image.height, image.width, patch_size * merge_size, min_pixels, max_pixels)
    except ValueError as e:
        raise ImageError(index, str(e)) from None
    resized = np.asarray(image.resize((w, h), resample=Image.Resampling.BICUBIC), dtype=np.uint8)  # [h, w, 3]
    recipe = (tuple(mean), tuple(std), patch_size, merge_size, temporal_patch_size)
    return Qwen2VLPixels(resized, (1, h // patch_size, w // patch_size), recipe)


def siglip_patches(
    image: Any,
    size: int,
    patch_size: int,
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5),
    std: tuple[float, float, float] = (0.5, 0.5, 0.5),
    resample: str = "bicubic",
) -> torch.Tensor:
    """A PIL image (RGB) → its patches [P, 3·p·p] float32 as a SigLIP tower reads them (models/siglip.py), by
    SiglipImageProcessor's rule (PaliGemma's and ColPali's processors): resize to size × size (Pillow's
    bicubic, ignoring the aspect ratio), scale to [0, 1], normalize, cut into patch × patch squares, row-major,
    each flattened in (channel, row, column) order: the layout of the patch embedding's Conv2d weight."""
    Image = _pil()
    if size % patch_size:
        raise ValueError(f"image size {size} is not a multiple of the patch size {patch_size}")
    filters = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}
    if resample not in filters:
        raise ValueError(f"unsupported resample {resample!r}; supported: {', '.join(filters)}")
    resized = image.resize((size, size), resample=filters[resample])
    x = np.asarray(resized, dtype=np.float32).transpose(2, 0, 1) * np.float32(1 / 255)  # [3, s, s]
    x = (x - np.asarray(mean, np.float32)[:, None, None]) / np.asarray(std, np.float32)[:, None, None]
    g, p = size // patch_size, patch_size
    x = x.reshape(3, g, p, g, p).transpose(1, 3, 0, 2, 4)  # [g, g, 3, p, p]
    return torch.from_numpy(np.ascontiguousarray(x).reshape(g * g, 3 * p * p))
