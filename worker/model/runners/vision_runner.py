"""Vision-language models on mlx-vlm (the optional `vision` extra).

Execution is mlx-vlm's BatchGenerator: sequences with and without images share the batch;
each prompt enters as input embeddings (the vision tower runs once, at admission). Text
handling (chat template, detokenizing, tool and reasoning parsing, constrained decoding)
is a ChatText, as in the MLX runner, on the same tokenizer files, loaded with mlx-lm.

Audio parts reach families whose processor reads 16 kHz audio (Gemma 4, ...): the processor
expands each part's marker into its audio tokens and computes its mel features, and the
audio tower encodes them while the prompt is embedded, as the vision tower does images.

mlx-vlm's generator draws every row with one sampler, so per-request temperature, top-p,
top-k and min-p are applied as a logits processor and the shared sampler draws at
temperature 1 (see sampling.sampling_processor), which also draws seeded requests itself.
Prompts enter mlx-vlm's prefix cache with their media's content hash in the block keys
(vision_prefix.py): a later turn about the same video reads the earlier turns' KV and, where
the cache covers all its media, does not run the vision tower again.

Rows are admitted by KV memory as text models' are (worker/model/memory/kv_budget.py): the
language model's cache is probed as mlx-lm's is, and a row's prompt is the processor's
token ids, in which every image already stands as its image tokens. A row with images
cannot be paused (its embeddings are not kept), so it reserves its whole reach; a text row
paused for memory reads its prompt and generated tokens again when it resumes."""

from __future__ import annotations

from pathlib import Path

from ....shared.errors import invalid
from ....shared.protocol import GenerateRequest
from ...text.chat_text import ChatText
from ..interfaces import Row, StepOutput, TokenOut
from ..memory.kv_budget import runner_profile
from .chat_runner import ChatTextRunner
from .vision_media import MediaPrompt, audio_seconds_heard, decode_image, decode_video, media_key, media_slots
from .vision_prefix import MediaPrefixStore, make_manager

# The processors' audio outputs (Gemma 3n / Gemma 4: mel features and their mask): read by the
# audio tower while embedding, never by the language model.
AUDIO_INPUTS = ("input_features", "input_features_mask", "audio_features", "audio_mask", "feature_attention_mask")


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
        prefix_memory_mb: int | None = None,
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
            apc_manager=(manager := make_manager(prefix_memory_mb)),
        )
        self.prefix = MediaPrefixStore(self.generator, manager)
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
        self.videos_seen = 0
        self.video_frames_seen = 0
        video_token = getattr(self.processor, "video_token", None)
        self.takes_video = (
            getattr(self.processor, "video_processor", None) is not None
            and video_token is not None
            and getattr(config, "video_token_id", None) is not None
        )

    # -- prompts ------------------------------------------------------------------------
    def encode(self, req: GenerateRequest) -> list[int]:
        """Token ids carrying the processor's outputs. The vision tower runs at admission
        (insert), so queued requests hold pixels, not embeddings."""
        images, videos, audio = req.images or [], req.videos or [], req.audio or []
        if req.messages is None or not (images or videos or audio):
            prompt = MediaPrompt(self.text.encode(req))
            prompt.cache_key = media_key(req)
            return prompt
        for kind, sent in (("image", images), ("video", videos), ("audio", audio)):
            slots = media_slots(req.messages, kind)
            if slots != len(sent):
                raise invalid(f"the messages reference {slots} {kind}s but {len(sent)} were sent", "messages")
        media = {"images": [decode_image(data, i) for i, data in enumerate(images)]}
        if videos:
            media.update(self._videos(videos, bool(images)))
        if audio:
            media["audio"] = self._audio(audio)
        text = self.text.apply_template(req, tokenize=False)
        if videos and text.count(self.processor.video_token) != len(videos):
            raise invalid("this model's chat template does not place video parts; it cannot take video", "messages")
        from mlx_vlm.utils import prepare_inputs

        try:
            inputs = dict(
                prepare_inputs(
                    self.processor,
                    **{k: v for k, v in media.items() if v},
                    prompts=text,
                    image_token_index=self.image_token,
                    add_special_tokens=False,
                )
            )
        except Exception as e:  # processors raise many types for odd images
            raise invalid(f"the media could not be prepared for this model: {e}", "messages") from None
        prompt = MediaPrompt(inputs["input_ids"][0].tolist())
        prompt.media = inputs
        prompt.cache_key = media_key(req)
        self.images_seen += len(images)
        self.videos_seen += len(videos)
        self.video_frames_seen += sum(len(v.get("frames") or ()) for v in videos)
        return prompt

    def _audio(self, parts: list[bytes]) -> list:
        """Each audio part (16 kHz mono int16 PCM from the gateway) as float samples, for an
        mlx-vlm family that reads audio; refused, by name, where this model hears none (its
        processor has no 16 kHz feature extractor, or its checkpoint no audio tower), where it
        hears one part only, or where a part is longer than the model hears (its processor
        would cut it short without a word)."""
        import numpy as np

        extractor = getattr(self.processor, "feature_extractor", None)
        why = None
        if extractor is None or getattr(extractor, "sampling_rate", 16000) != 16000:
            why = "its processor reads no 16 kHz audio"
        elif getattr(self.model, "audio_tower", True) is None:
            why = "its checkpoint has no audio encoder"
        if why is not None:
            raise invalid(
                f"this model does not accept audio ({why}); an operator can set chat.audio_model to a "
                "speech-to-text model so audio parts are transcribed for it",
                "messages",
            )
        if len(parts) > 1 and not getattr(self.processor, "supports_multiple_audio", False):
            raise invalid(f"this model takes one audio part per request; {len(parts)} were sent", "messages")
        longest = audio_seconds_heard(self.processor)
        samples = [np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0 for pcm in parts]
        for i, s in enumerate(samples):
            if longest is not None and s.size / 16000 > longest + 1e-6:
                raise invalid(
                    f"audio {i} is {s.size / 16000:.1f} seconds long; this model hears at most {longest:g} seconds",
                    "messages",
                )
        return samples

    def _videos(self, videos: list[dict], with_images: bool) -> dict:
        """prepare_inputs' video arguments: each video's frames as a (T, C, H, W) array, and
        the rate they were sampled at (the processor's timestamps); refused, by name, where
        this model's processor reads no video."""
        if not self.takes_video:
            raise invalid("this model does not accept video (its processor reads images only)", "messages")
        if with_images:  # Qwen2-VL embeds one kind of media per prompt (one grid, one pixel tensor)
            raise invalid("send images and video in separate requests to this model", "messages")
        arrays = [decode_video(v.get("frames") or [], i) for i, v in enumerate(videos)]
        return {"videos": arrays, "fps": [float(v.get("fps") or 2.0) for v in videos]}

    def _embed(self, ids, inputs: dict) -> dict:
        """The generator's prompt kwargs: input embeddings plus what the model needs with them
        (image grid sizes, mrope positions, ...)."""
        extra = {k: v for k, v in inputs.items() if k not in ("pixel_values", "attention_mask")}
        embedded = self.model.get_input_embeddings(
            ids, inputs.get("pixel_values"), mask=inputs.get("attention_mask"), **extra
        )
        extra.pop("cached_image_features", None)  # the tower's stand-in: for the embedding only
        for key in AUDIO_INPUTS:  # consumed by the embedding; a batch must not concatenate them
            extra.pop(key, None)
        if "pixel_values" not in inputs and "pixel_values_videos" not in inputs:
            extra.pop("mm_token_type_ids", None)  # marks vision spans only; a text row has none
        kwargs = {**extra, **{k: v for k, v in embedded.to_dict().items() if v is not None}}
        self._mx.eval([v for v in kwargs.values() if isinstance(v, self._mx.array)])
        return kwargs

    # -- execution ----------------------------------------------------------------------
    def insert(self, row: Row) -> tuple[int, int]:
        from .sampling import guard_processor, guarded_processors, sampling_processor

        prompt, sampling, guard = row.prompt, row.sampling, row.guard
        inputs = dict(getattr(prompt, "media", None) or {})
        ids = inputs.pop("input_ids", None)
        salt = self.prefix.salt(prompt)
        cached, held = self.prefix.lookup(list(prompt), salt)
        try:
            inputs.update(self.prefix.skip_encoding(self.model, list(prompt), cached))
            prompt_kwargs = self._embed(ids if ids is not None else self._mx.array([list(prompt)]), inputs)
        except Exception as e:  # the vision tower refused these images: this request's error only
            if held:
                self.prefix.manager.release(held)
            raise invalid(f"the model could not encode the images: {e}", "messages") from None
        prompt_kwargs["_apc_semantic_hash"] = salt  # the blocks' key: mlx-vlm strips it before the model

        processors = guarded_processors(sampling, row.constraint, guard)
        draw = sampling_processor(sampling)  # last: it turns logits into the draw distribution
        processors.append(guard_processor(draw, guard) if guard is not None else draw)
        (uid,) = self.generator.insert(
            [list(prompt)], max_tokens=[row.max_tokens], prompt_kwargs=[prompt_kwargs], logits_processors=[processors]
        )
        self.prefix.hold(uid, held)
        if isinstance(prompt, MediaPrompt):  # a resumed row's prompt is a plain list of ids
            prompt.media = None  # the pixels are in the embeddings now; do not hold them to the end
        return uid, cached

    def step(self) -> StepOutput:
        _, gen_responses = self.generator.next()
        for r in gen_responses:  # prefilled: its own lookup holds the blocks now
            self.prefix.release(r.uid)
        return StepOutput(tokens=[TokenOut(r.uid, int(r.token), r.finish_reason) for r in gen_responses])

    def remove(self, uids: list[int]) -> None:
        for uid in uids:
            self.generator.remove(uid)
            self.prefix.release(uid)

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
            "videos_seen": self.videos_seen,
            "video_frames_seen": self.video_frames_seen,
        }

    def cache_stats(self) -> dict:
        return self.prefix.stats()

    def limit_prefix_cache(self, max_bytes: int) -> None:
        self.prefix.limit(max_bytes)

    def cache_clear(self) -> None:
        self.prefix.clear()
        self._mx.clear_cache()
