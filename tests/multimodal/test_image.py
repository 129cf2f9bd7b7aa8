"""Image decoding and checks, and Qwen2-VL's pixel patches against transformers' processor."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

pytest.importorskip("PIL", reason="Pillow is the vision extra (tests/models.txt installs it with the test extra)")
from PIL import Image, ImageOps  # noqa: E402

from polyvec.multimodal.image import ImageError, load_image, qwen2_vl_patches, smart_resize  # noqa: E402


def _image(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if channels == 1 else data, mode)


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("size", "pixels"),
    [((640, 480), None), ((97, 53), None), ((2000, 300), (56 * 56, 28 * 28 * 64)), ((20, 20), (200 * 200, 10**6))],
)
def test_patches_equal_transformers_processor(size, pixels):
    """The resized, normalized patches and the grid as transformers' Qwen2-VL processor makes them (within 1e-6):
    a plain size, sides not multiples of 28, an image over max_pixels, one under min_pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = _image(*size)
    kwargs = {} if pixels is None else {"min_pixels": pixels[0], "max_pixels": pixels[1]}
    ref = Qwen2VLImageProcessorPil(**kwargs)(images=[image], return_tensors="pt")
    got = qwen2_vl_patches(image, **kwargs)
    assert list(got.grid_thw) == ref["image_grid_thw"][0].tolist()
    assert got.patches.shape == ref["pixel_values"].shape
    assert (got.patches - ref["pixel_values"].float()).abs().max() <= 1e-6
    # held until its batch runs as the resized image's bytes (its float32 patches, two frames, were 8x that)
    h, w = got.grid_thw[1] * 14, got.grid_thw[2] * 14
    assert got.num_patches == got.patches.shape[0] and got.data.nbytes == h * w * 3


def test_transparent_images_are_on_white_as_transformers_makes_them():
    """RGBA, LA and palette images with transparency: patches as transformers' processor makes them, whose
    convert_to_rgb puts transparent pixels on white (vLLM too); load_image's convert("RGB") made them black."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rgba = np.random.default_rng(0).integers(0, 256, (40, 60, 4), dtype=np.uint8)
    rgba[..., 3] = 0
    rgba[:20, :, 3] = 255
    rgba[20:30, :, 3] = 128
    palette = Image.fromarray(rgba[..., :3], "RGB").quantize(16)
    palette.info["transparency"] = 3
    for image in (Image.fromarray(rgba, "RGBA"), Image.fromarray(rgba, "RGBA").convert("LA"), palette):
        ref = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=50176)(images=[image], return_tensors="pt")
        got = qwen2_vl_patches(load_image(image), 3136, 50176)
        assert (got.patches - ref["pixel_values"].float()).abs().max() <= 1e-6, image.mode


def test_smart_resize_rule():
    assert smart_resize(480, 640, 28, 56 * 56, 28 * 28 * 1280) == (476, 644)
    h, w = smart_resize(4000, 3000, 28, 56 * 56, 28 * 28 * 256)
    assert h % 28 == w % 28 == 0 and h * w <= 28 * 28 * 256
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 3000, 28, 56 * 56, 28 * 28 * 1280)


def test_load_image_forms_and_modes():
    rgb = _image(40, 30)
    url = "data:image/png;base64," + base64.b64encode(_png(rgb)).decode()
    for source in (rgb, _png(rgb), url):
        got = load_image(source)
        assert got.mode == "RGB" and got.size == (40, 30)
        assert np.array_equal(np.asarray(got), np.asarray(rgb))
    assert load_image(_image(8, 8, "RGBA")).mode == "RGB" and load_image(_png(_image(8, 8, "L"))).mode == "RGB"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (b"not an image at all", "not a readable image"),
        (_png(_image(64, 64))[:200], "not a readable image"),  # truncated
        ("http://example.com/a.png", r"fetched only from --allowed-media-domains \(allowed: none\)"),
        ("ftp://example.com/a.png", "must be a base64 data: URL"),
        ("data:image/png,rawbytes", "not base64-encoded"),
        ("data:image/png;base64,@@@", "does not decode"),
        (12, "expected a PIL image, bytes or a data: URL, got int"),
    ],
)
def test_bad_images_name_the_item(source, message):
    with pytest.raises(ImageError, match=message) as err:
        load_image(source, index=3)
    assert err.value.index == 3 and str(err.value).startswith("image 3: ")


def test_exif_orientation_and_formats_as_vllm_reads_them(tmp_path):
    """vLLM 0.34 reads image bytes with Pillow's still-image formats only (EPS would run Ghostscript on the
    client's PostScript) and turns them as their EXIF orientation says; a PIL image is taken as it is."""
    image = _image(90, 30)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90° clockwise to display
    buf = io.BytesIO()
    image.save(buf, "PNG", exif=exif.tobytes())
    upright = load_image(buf.getvalue())
    assert upright.size == (30, 90)
    assert np.array_equal(np.asarray(upright), np.asarray(ImageOps.exif_transpose(Image.open(buf))))
    assert load_image(Image.open(buf)).size == (90, 30)  # an object: the caller's pixels
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 60 45\n0 0 moveto 60 45 lineto stroke\nshowpage\n%%EOF\n"
    with pytest.raises(ImageError, match="image 2: not a readable image \\(none of the accepted image formats\\)"):
        load_image(eps, index=2)
    assert load_image(memoryview(_png(image))).size == (90, 30)
    assert load_image("DATA:image/png;base64," + base64.b64encode(_png(image)).decode()).size == (90, 30)


def test_a_pil_image_that_fails_to_decode_names_its_index(tmp_path):
    path = tmp_path / "cut.png"
    path.write_bytes(_png(_image(64, 64))[:300])
    with pytest.raises(ImageError, match="^image 4: not a readable image \\(OSError: image file is truncated\\)"):
        load_image(Image.open(path), index=4)
    path.write_bytes(_png(_image(8, 8)))
    with Image.open(path) as closed:
        pass
    with pytest.raises(ImageError, match="^image 1: not a readable image"):
        load_image(closed, index=1)


def test_pixel_limits():
    big = _png(_image(300, 200))
    with pytest.raises(ImageError, match="60000 pixels|300x200 pixels, more than the limit of 1000"):
        load_image(big, max_pixels=1000)
    with pytest.raises(ImageError, match="300x200 pixels"):
        load_image(_image(300, 200), max_pixels=1000)
    with pytest.raises(ImageError, match="aspect ratio"):
        qwen2_vl_patches(_image(4000, 10))
    patches = qwen2_vl_patches(_image(56, 56)).patches
    assert patches.dtype == torch.float32 and patches.shape == (16, 3 * 2 * 14 * 14)


def _patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[3, S, S] → [P, 3·p·p]: patches row-major, each in (channel, row, column) order."""
    c, s, _ = pixels.shape
    g = s // patch
    return pixels.reshape(c, g, patch, g, patch).permute(1, 3, 0, 2, 4).reshape(g * g, c * patch * patch)


@pytest.mark.parametrize(("size", "mode", "side", "patch"), [((200, 150), "RGB", 56, 14), ((90, 300), "RGBA", 64, 16)])
def test_siglip_patches_equal_transformers_processor(size, mode, side, patch):
    """SigLIP's (PaliGemma's) patches as transformers' slow SiglipImageProcessor makes them, patchified the way
    the Conv2d reads them (within 1e-6): an RGB image and an RGBA one (transparent pixels on white)."""
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from polyvec.multimodal.image import siglip_patches

    raw = _image(*size, mode=mode, seed=7)
    processor = SiglipImageProcessorPil(size={"height": side, "width": side}, resample=3, image_mean=[0.5] * 3,
                                        image_std=[0.5] * 3)  # fmt: skip
    ref = processor(images=[raw], return_tensors="pt")["pixel_values"]
    assert ref.shape == (1, 3, side, side)
    got = siglip_patches(load_image(raw), side, patch)
    assert got.dtype == torch.float32 and got.shape == ((side // patch) ** 2, 3 * patch * patch)
    assert (got - _patchify(ref[0].float(), patch)).abs().max() <= 1e-6
    # the layout: the first patch is the image's top-left patch × patch square, channel by channel
    assert (got[0].view(3, patch, patch) - ref[0, :, :patch, :patch].float()).abs().max() <= 1e-6


def test_remote_fetch_follows_only_allowed_redirects_and_has_a_deadline(tmp_path):
    from polyvec.multimodal.image import fetch_image
    from tests.helpers import serve_folder

    (tmp_path / "page.png").write_bytes(_png(_image(20, 10)))
    with serve_folder(tmp_path) as base:  # http://127.0.0.1:PORT
        port = base.rsplit(":", 1)[1]
        to_allowed = f"{base}/redirect?to={base}/page.png"
        assert fetch_image(to_allowed, 0, ("127.0.0.1",), 1 << 20, 5.0) == (tmp_path / "page.png").read_bytes()
        # the same file under a host name the deployment did not allow: a redirect must not get around the list
        to_other = f"{base}/redirect?to=http://localhost:{port}/page.png"
        with pytest.raises(ImageError, match="'localhost' is not one of them"):
            fetch_image(to_other, 2, ("127.0.0.1",), 1 << 20, 5.0)
        with pytest.raises(ImageError, match="is not allowed|not one of them"):  # urllib or our check
            fetch_image(f"{base}/redirect?to=file:///etc/passwd", 0, ("127.0.0.1",), 1 << 20, 5.0)
        # a host that trickles bytes (one each 0.2 s, each read within the timeout) is cut off at the deadline
        with pytest.raises(ImageError, match=r"took more than 0.5 s"):
            fetch_image(f"{base}/slow", 1, ("127.0.0.1",), 1 << 20, 5.0, deadline=0.5)


def test_modes_beyond_8_bits_are_refused_not_clipped():
    """Pillow's RGB conversion clips 16-bit and float pixels to 255 (a white page): refused, naming the mode."""
    wide = Image.fromarray(np.full((16, 16), 40000, dtype=np.uint16))  # mode I;16
    for image in (wide, Image.fromarray(np.full((8, 8), 0.5, dtype=np.float32)), wide.convert("I")):
        with pytest.raises(ImageError, match=rf"image 4: mode {image.mode} \(16-bit or more per channel\)"):
            load_image(_png(image) if image.mode == "I;16" else image, index=4)
    for mode in ("P", "CMYK", "LA"):  # converted faithfully
        assert load_image(_image(8, 8).convert(mode)).mode == "RGB"
    with pytest.raises(ImageError, match=r"none of the accepted image formats\)$"):  # no object repr in the message
        load_image(b"\x89PNx not an image")


def test_pixel_limit_above_pillows_own(tmp_path):
    """A configured limit over Pillow's bomb threshold (~89.5M pixels) is the limit: the header is read and handed
    on, not refused as a bomb (nothing is decoded: before_decode stops it)."""
    big = _png(Image.new("1", (10_000, 9_500)))  # 95M pixels

    def stop(width: int, height: int) -> None:
        raise ImageError(7, f"header read: {width * height} pixels")

    with pytest.raises(ImageError, match="image 7: header read: 95000000 pixels"):
        load_image(big, max_pixels=200_000_000, before_decode=stop)
    with pytest.raises(ImageError, match="10000x9500 pixels, more than the limit of 50000000"):
        load_image(big)
