"""Images in API requests: OpenAI ``image_url`` content parts (and Anthropic ``image`` blocks, which the Messages
API translates into them) become image references in request order, each replaced in the prompt text by the image placeholder; the server then fetches
(remote URLs only when allowed), decodes and preprocesses them off the event loop, and counts their span tokens.

A request's images fail as a 400 naming the part (``messages[0].content[1]``) before the engine sees them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from .protocol import APIError, ImageRef, invalid

if TYPE_CHECKING:
    from ..engine.interface import Engine

MAX_REMOTE_SECONDS = 10.0


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


async def prepare_images(refs: list[ImageRef], engine: Engine, allow_remote: bool) -> list[Any]:
    """Bytes → preprocessed :class:`~flashserve.engine.images.ImageInput` per reference, or a 400 naming the
    part. Decoding runs in a worker thread; the vision tower runs later, in the engine."""
    from ..engine.images import ImageError, decode_image, preprocess

    if not engine.reads_images:
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
            out.append(await asyncio.to_thread(preprocess, img, engine.model_config.vision))
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
