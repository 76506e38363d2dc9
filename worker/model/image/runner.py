"""mlx-vlm's image models (Z-Image, FLUX.2, Qwen-Image, ERNIE-Image, ...: whichever family
`mlx_vlm.generate.image` recognises) for a `kind: image` worker. MLX arrays belong to the thread
that made them ("There is no Stream(cpu, 0) in current thread") and one image can take minutes:
the model loads and runs on a thread of its own, which the scheduler's steps only look at. An
edit loads the family's edit pipeline once (sharing the generator's weights where it allows)."""

from __future__ import annotations

import io
import random
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ....shared import protocol as p
from ....shared.errors import ErrorCode, ServiceError


class ImageRunner:
    context_length = 32000  # prompt characters, OpenAI's limit for its image models

    def __init__(self, folder: Path):
        self.folder = folder
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="image")
        self.model = self._thread.submit(self._load, "generate").result()  # a load failure raises here
        self.edit_model = None
        self.images = 0

    def _load(self, task: str):
        from mlx_vlm.generate.image import load_image_model

        shared = _shared_edit_model(self.model) if task == "edit" else None
        if shared is not None:
            return shared
        return load_image_model(str(self.folder), task=task)

    def draw(self, req: p.ImageRequest, index: int) -> Future:
        """The index-th image of req (PNG bytes), drawn on the image thread."""
        return self._thread.submit(self._draw, req, index)

    def _draw(self, req: p.ImageRequest, index: int) -> bytes:
        from mlx_vlm.generate.image import ImageGenerationRequest, generate_image

        seed = (req.seed if req.seed is not None else random.randrange(2**31)) + index
        options = dict(seed=seed, steps=req.steps, guidance=req.guidance, width=req.width, height=req.height)
        if req.image is None:
            image = generate_image(self.model, ImageGenerationRequest(prompt=req.prompt, **options)).to_pil()
        else:
            image = self._edit(req, options)
        self.images += 1
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()

    def _edit(self, req: p.ImageRequest, options: dict):
        from mlx_vlm.generate.edit_image import ImageEditRequest
        from mlx_vlm.generate.image import generate_image
        from PIL import Image

        if self.edit_model is None:
            try:
                self.edit_model = self._load("edit")
            except ValueError as e:  # the family generates only
                raise ServiceError(ErrorCode.INVALID_REQUEST, f"this model does not edit images: {e}") from None
        source = Image.open(io.BytesIO(req.image)).convert("RGB")
        with tempfile.TemporaryDirectory(prefix="mlxgw-edit-") as tmp:
            path = Path(tmp) / "source.png"  # mlx-vlm's edit pipelines read their sources from files
            source.save(path)
            edit = ImageEditRequest(prompt=req.prompt, image_paths=(str(path),), **options)
            edited = generate_image(self.edit_model, edit, task="edit").to_pil().convert("RGB")
        edited = edited.resize((req.width, req.height)) if edited.size != (req.width, req.height) else edited
        if req.mask is None:
            return edited
        # OpenAI's mask: its transparent pixels are what may change; elsewhere the source stays.
        alpha = Image.open(io.BytesIO(req.mask)).convert("RGBA").getchannel("A").resize(edited.size)
        keep = source.resize(edited.size)
        return Image.composite(keep, edited, alpha)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict:
        return {"images": self.images}

    def cache_stats(self) -> dict:
        return {}

    def cache_clear(self) -> None:
        pass


def _shared_edit_model(model):
    """The family's edit model over the generator's own pipeline, where both are dataclasses of
    (pipeline, model_id) and the pipeline edits: one copy of the weights, not two."""
    from mlx_vlm.generate.edit_image import _image_edit_model_class_for_type

    cls = _image_edit_model_class_for_type(getattr(model, "model_type", None))
    pipeline = getattr(model, "pipeline", None)
    names = getattr(cls, "__dataclass_fields__", {})
    if cls is None or pipeline is None or not hasattr(pipeline, "edit_array") or "pipeline" not in names:
        return None
    return cls(pipeline=pipeline, model_id=model.model_id)
