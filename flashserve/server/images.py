"""Images in API requests: OpenAI ``image_url`` content parts (and Anthropic ``image`` blocks, which the Messages
API translates into them) become image references in request order, each replaced in the prompt text by the image placeholder; the server then fetches
(remote URLs only when allowed), decodes and preprocesses them off the event loop, and counts their span tokens.

A request's images fail as a 400 naming the part (``messages[0].content[1]``) before the engine sees them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from .protocol import APIError, invalid

IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"  # the V4.1 tokenizer's image token (spec §7): one per image
MAX_REMOTE_SECONDS = 10.0


@dataclass(frozen=True)
class ImageRef:
    """One image of a request: a data URL's bytes, or a remote URL to fetch; ``param`` names its part."""

    param: str
    data: bytes | None = None
    url: str | None = None


def openai_image_part(part: dict[str, Any], param: str) -> ImageRef:
    """``{"type": "image_url", "image_url": {"url": ...}}`` (or the URL as a string)."""
    from ..engine.images import ImageError, bytes_from_data_url

    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise invalid(f"{param}.image_url.url", f"'{param}.image_url.url' must be a string URL", "invalid_type")
    if url.startswith("data:"):
        try:
            return ImageRef(param, data=bytes_from_data_url(url))
        except ImageError as e:
            raise invalid(f"{param}.image_url.url", str(e), "invalid_image") from None
    if url.startswith(("http://", "https://")):
        return ImageRef(param, url=url)
    raise invalid(f"{param}.image_url.url", "image URLs must be data: URLs (or http(s) when the server allows "
                  "remote images)", "invalid_image")


async def _fetch(ref: ImageRef, max_bytes: int) -> bytes:
    import httpx

    try:
        async with httpx.AsyncClient(timeout=MAX_REMOTE_SECONDS, follow_redirects=True) as client:
            async with client.stream("GET", ref.url) as resp:
                if resp.status_code != 200:
                    raise invalid(ref.param, f"fetching {ref.url} answered HTTP {resp.status_code}", "invalid_image")
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > max_bytes:
                        raise invalid(ref.param, f"{ref.url} is over {max_bytes} bytes", "invalid_image")
                return bytes(body)
    except httpx.HTTPError as e:
        raise invalid(ref.param, f"could not fetch {ref.url} ({type(e).__name__})", "invalid_image") from None


async def prepare_images(refs: list[ImageRef], engine: Any, allow_remote: bool) -> list[Any]:
    """Bytes → preprocessed :class:`~flashserve.engine.images.ImageInput` per reference, or a 400 naming the
    part. Decoding runs in a worker thread; the vision tower runs later, in the engine."""
    from ..engine.images import ImageError, decode_image, preprocess

    model = engine.model
    if model.vision is None:
        raise invalid(refs[0].param, "this model reads text only (no vision tower): remove the images",
                      "unsupported_value")
    limits = engine.image_limits
    if len(refs) > limits.max_images:
        raise invalid(refs[limits.max_images].param, f"{len(refs)} images exceed the limit of "
                      f"{limits.max_images} per request", "too_many_images")
    out = []
    for ref in refs:
        data = ref.data
        if data is None:
            if not allow_remote:
                raise invalid(ref.param, "remote image URLs are off on this server (start it with "
                              "--allow-remote-images); send the image as a base64 data URL", "invalid_image")
            data = await _fetch(ref, limits.max_bytes)
        try:
            img = await asyncio.to_thread(decode_image, data, limits)
            out.append(await asyncio.to_thread(preprocess, img, model.cfg.vision))
        except ImageError as e:
            raise invalid(ref.param, str(e), "invalid_image") from None
    return out


def expanded_ids(ids: list[int], images: list[Any], image_token_id: int) -> list[int]:
    """The prompt ids as the engine will run them (each placeholder replaced by its span), for lengths and
    usage; a count mismatch is the client's (a placeholder typed as text)."""
    from ..engine.images import ImageError, expand_placeholders

    try:
        return expand_placeholders(ids, images, image_token_id)[0]
    except ImageError as e:
        raise APIError(str(e), param="messages", code="invalid_image") from None
