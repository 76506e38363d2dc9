"""Vision-language models on mlx-vlm (the optional `vision` extra).

Execution is mlx-vlm's BatchGenerator: sequences with and without images share the batch;
each prompt enters as input embeddings (the vision tower runs once, at admission). Text
handling (chat template, detokenizing, tool and reasoning parsing, constrained decoding)
is a ChatText, as in the MLX runner, on the same tokenizer files, loaded with mlx-lm.

mlx-vlm's generator draws every row with one sampler, so per-request temperature, top-p,
top-k and min-p are applied as a logits processor and the shared sampler draws at
temperature 1 (see sampling.sampling_processor), which also draws seeded requests itself.
No prefix cache here: each prompt's image embeddings are computed at admission.

Rows are admitted by KV memory as text models' are (worker/model/memory/kv_budget.py): the
language model's cache is probed as mlx-lm's is, and a row's prompt is the processor's
token ids, in which every image already stands as its image tokens. A row with images
cannot be paused (its embeddings are not kept), so it reserves its whole reach; a text row
paused for memory reads its prompt and generated tokens again when it resumes."""

from __future__ import annotations

import io
from pathlib import Path

from ....shared.errors import invalid
from ....shared.protocol import GenerateRequest
from ...text.chat_text import ChatText
from ..interfaces import Row, StepOutput, TokenOut
from ..memory.kv_budget import runner_profile
from .chat_runner import ChatTextRunner

# Larger images are refused before decoding (a small file can decode to gigapixels).
MAX_IMAGE_PIXELS = 40_000_000


class MediaPrompt(list):
    """Token ids that also carry the processor's outputs (pixel values, grid sizes, ...)
    from encode() to insert(), through a scheduler that only sees a list of ids."""

    media: dict | None = None


def decode_image(data: bytes, index: int):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_IMAGE_PIXELS:
            raise invalid(
                f"image {index} is {img.width}x{img.height} pixels; the limit is {MAX_IMAGE_PIXELS} pixels", "messages"
            )
        img.load()
        return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise invalid(f"image {index} could not be decoded: {e}", "messages") from None


class VisionRunner(ChatTextRunner):
    supports_layer_progress = True

    def __init__(
        self,
        model_path: Path,
        *,
        context_length: int | None,
        max_num_seqs: int,
        prefill_step_size: int,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        allow_request_chat_template: bool = False,
        chat_template: str | None = None,
    ):
        try:
            import mlx.core as mx
            from mlx_lm.utils import load_tokenizer
            from mlx_vlm import load
            from mlx_vlm.generate import BatchGenerator
        except ImportError as e:
            raise RuntimeError(f"vision models need the vision extra (pip install 'mlxgw[vision]'): {e}") from None

        self._mx = mx
        self.model, self.processor = load(str(model_path))
        config = self.model.config
        text_config = getattr(config, "text_config", None) or config
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        self.tokenizer = load_tokenizer(model_path, eos_token_ids=[t for t in eos if t is not None] or None)
        self.vocab_size = int(getattr(text_config, "vocab_size", None) or config.vocab_size)
        model_context = int(getattr(text_config, "max_position_embeddings", None) or 4096)
        self.context_length = min(context_length or model_context, model_context)
        self.image_token = getattr(config, "image_token_index", None) or getattr(config, "image_token_id", None)
        self.generator = BatchGenerator(
            self.model.language_model,
            self.processor,
            stop_tokens=[[t] for t in sorted(self.tokenizer.eos_token_ids)],
            sampler=lambda logprobs: mx.random.categorical(logprobs),
            completion_batch_size=max_num_seqs,
            prefill_batch_size=max_num_seqs,
            prefill_step_size=prefill_step_size,
            compute_logprobs=False,
        )
        self.text = ChatText(
            self.tokenizer,
            self.vocab_size,
            tool_parser=tool_parser,
            reasoning_parser=reasoning_parser,
            allow_request_chat_template=allow_request_chat_template,
            context_length=self.context_length,
            chat_template=chat_template,
        )
        self.images_seen = 0

    # -- prompts ------------------------------------------------------------------------
    def encode(self, req: GenerateRequest) -> list[int]:
        """Token ids carrying the processor's outputs. The vision tower runs at admission
        (insert), so queued requests hold pixels, not embeddings."""
        images = req.images or []
        if req.messages is None or not images:
            return MediaPrompt(self.text.encode(req))
        slots = sum(
            1
            for m in req.messages
            if isinstance(m.get("content"), list)
            for part in m["content"]
            if isinstance(part, dict) and part.get("type") == "image"
        )
        if slots != len(images):
            raise invalid(f"the messages reference {slots} images but {len(images)} were sent", "messages")
        pictures = [decode_image(data, i) for i, data in enumerate(images)]
        text = self.text.apply_template(req, tokenize=False)
        from mlx_vlm.utils import prepare_inputs

        try:
            inputs = dict(
                prepare_inputs(
                    self.processor,
                    images=pictures,
                    prompts=text,
                    image_token_index=self.image_token,
                    add_special_tokens=False,
                )
            )
        except Exception as e:  # processors raise many types for odd images
            raise invalid(f"the images could not be prepared for this model: {e}", "messages") from None
        prompt = MediaPrompt(inputs["input_ids"][0].tolist())
        prompt.media = inputs
        self.images_seen += len(pictures)
        return prompt

    def _embed(self, ids, inputs: dict) -> dict:
        """The generator's prompt kwargs: input embeddings plus what the model needs with them
        (image grid sizes, mrope positions, ...)."""
        extra = {k: v for k, v in inputs.items() if k not in ("pixel_values", "attention_mask")}
        embedded = self.model.get_input_embeddings(
            ids, inputs.get("pixel_values"), mask=inputs.get("attention_mask"), **extra
        )
        kwargs = {**extra, **{k: v for k, v in embedded.to_dict().items() if v is not None}}
        self._mx.eval([v for v in kwargs.values() if isinstance(v, self._mx.array)])
        return kwargs

    # -- execution ----------------------------------------------------------------------
    def insert(self, row: Row) -> tuple[int, int]:
        from .sampling import guard_processor, guarded_processors, sampling_processor

        prompt, sampling, guard = row.prompt, row.sampling, row.guard
        inputs = dict(getattr(prompt, "media", None) or {})
        ids = inputs.pop("input_ids", None)
        try:
            prompt_kwargs = self._embed(ids if ids is not None else self._mx.array([list(prompt)]), inputs)
        except Exception as e:  # the vision tower refused these images: this request's error only
            raise invalid(f"the model could not encode the images: {e}", "messages") from None

        processors = guarded_processors(sampling, row.constraint, guard)
        draw = sampling_processor(sampling)  # last: it turns logits into the draw distribution
        processors.append(guard_processor(draw, guard) if guard is not None else draw)
        (uid,) = self.generator.insert(
            [list(prompt)], max_tokens=[row.max_tokens], prompt_kwargs=[prompt_kwargs], logits_processors=[processors]
        )
        if isinstance(prompt, MediaPrompt):  # a resumed row's prompt is a plain list of ids
            prompt.media = None  # the pixels are in the embeddings now; do not hold them to the end
        return uid, 0

    def step(self) -> StepOutput:
        _, gen_responses = self.generator.next()
        return StepOutput(tokens=[TokenOut(r.uid, int(r.token), r.finish_reason) for r in gen_responses])

    def remove(self, uids: list[int]) -> None:
        for uid in uids:
            self.generator.remove(uid)

    # -- introspection -------------------------------------------------------------------
    def kv_profile(self):
        """The language model's KV per row, measured on a fresh cache of the kind mlx-vlm's
        BatchGenerator batches (the vision tower holds no per-row cache)."""
        from mlx_vlm.models.cache import make_prompt_cache

        language = self.model.language_model
        return runner_profile(language, make_prompt_cache(language))

    def stats(self) -> dict:
        mx = self._mx
        return {
            "mlx_active_bytes": int(mx.get_active_memory()),
            "mlx_peak_bytes": int(mx.get_peak_memory()),
            "images_seen": self.images_seen,
        }

    def cache_stats(self) -> dict:
        return {}

    def cache_clear(self) -> None:
        self._mx.clear_cache()
