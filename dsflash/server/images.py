"""Images in API requests: OpenAI `image_url` parts, Anthropic `image` blocks and Responses
`input_image` parts, as base64 `data:` URLs (the server fetches nothing from the network).

Each image is replaced in the conversation text by a mark; after the V4.1 encoding, the text between
marks is tokenized piece by piece and each mark becomes the image's span of image-token positions
(START, rows of IMAGE and NEW_LINE, END), whose rows the vision tower fills.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from dsflash.engine.images import ImageSpan
from dsflash.model.vision import preprocess_image

IMAGE_MARK = "\ue000dsflash-image\ue000"  # private-use characters: no tokenizer produces this text


class ImageError(ValueError):
    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class Images:
    """The images of one request, in the order their marks appear."""

    def __init__(self) -> None:
        self.data: list[tuple[bytes, str]] = []  # (encoded image, field it came from)

    def add_data_url(self, url: Any, field: str) -> str:
        if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
            raise ImageError(f"{field}: only base64 data: URLs are accepted (the server fetches nothing)", field)
        return self.add_base64(url.split(";base64,", 1)[1], field)

    def add_base64(self, data: Any, field: str) -> str:
        try:
            self.data.append((base64.b64decode(data, validate=True), field))
        except (binascii.Error, TypeError, ValueError) as e:
            raise ImageError(f"{field}: not valid base64 ({e})", field) from e
        return IMAGE_MARK

    def openai_messages(self, messages: list[dict]) -> list[dict]:
        """Chat messages with every image_url part replaced by a text part holding the mark."""
        out = []
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(content, list):
                out.append(m)
                continue
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    parts.append({"type": "text", "text": self.add_data_url(url, f"messages[{i}].content[{j}]")})
                else:
                    parts.append(part)
            out.append({**m, "content": parts})
        return out

    def prompt(self, text: str, tokenize, engine) -> tuple[list[int], list[ImageSpan]]:
        """Token ids of the encoded `text` with each mark replaced by its image's span."""
        pieces = text.split(IMAGE_MARK)
        if len(pieces) - 1 != len(self.data):
            raise ImageError("the text of the request contains the image mark itself", "messages")
        if self.data and engine.args.vision_n_layers == 0:
            raise ImageError("this model has no vision tower: it takes no images", self.data[0][1])
        ids: list[int] = []
        spans: list[ImageSpan] = []
        for k, piece in enumerate(pieces):
            ids += tokenize(piece) if piece else []
            if k < len(self.data):
                raw, field = self.data[k]
                try:
                    image = preprocess_image(raw, engine.args)
                except Exception as e:  # Pillow's errors for unreadable data are of many kinds
                    raise ImageError(f"{field}: not a readable image ({e})", field) from e
                spans.append(ImageSpan(len(ids), image))
                ids += [engine.args.image_token_id] * spans[-1].length
        return ids, spans
