"""Tiny checkpoints of model types no vlft family owns, written as a user's would be: by plain transformers from
the config classes, with the model's processor classes, a small tokenizer (the tiny families' BPE builder) and
a chat template in the real model's style, ``save_pretrained`` into a folder. No download.

``build(kind, path)``: 'mistral3' (Pixtral vision tower, patch merger, Mistral text; its processor writes
``[IMG]`` rows closed by ``[IMG_BREAK]`` and ``[IMG_END]``; Mistral-Small-3.1's template, which has no
``{% generation %}`` markers) or 'llava' (CLIP + Llama, LLaVA-1.5's template with ``{% generation %}``
markers) or 'internvl' (InternViT + Qwen2, tiles of <img><IMG_CONTEXT>...</img>; InternVL 3's template; clips as frames of
tiles) or 'llava_next_video' (CLIP + Llama, clips through ``get_video_features``). ``MARKED['mistral3']`` is that template with the markers added: the tests' oracle for the assistant
spans."""

from __future__ import annotations

from pathlib import Path

MISTRAL3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{{ message['content'] if message['content'] is string else message['content'][0]['text'] }}[/SYSTEM_PROMPT]"
    "{%- elif message['role'] == 'user' %}[INST]"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- else %}"
    "{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{ block['text'] }}"
    "{%- elif block['type'] in ['image', 'image_url'] %}[IMG]{%- endif %}"
    "{%- endfor %}{%- endif %}[/INST]"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- else %}"
    "{%- for block in message['content'] %}{{ block['text'] }}{%- endfor %}{%- endif %}{{ eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)
MARKED = {
    "mistral3": MISTRAL3_TEMPLATE.replace(
        "{%- elif message['role'] == 'assistant' %}", "{%- elif message['role'] == 'assistant' %}{% generation %}"
    ).replace("{{ eos_token }}", "{{ eos_token }}{% endgeneration %}")
}

LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% for item in message['content'] | selectattr('type', 'equalto', 'text') %}{{ item['text'] }}{% endfor %}"
    "{{ eos_token }}{% endgeneration %}{{ ' ' }}"
    "{% else %}"
    "{% for item in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for item in message['content'] | selectattr('type', 'equalto', 'text') %}{{ item['text'] + ' ' }}{% endfor %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# LLaVA-NeXT-Video's (llava-hf): images, then clips, then the text of each turn; replies marked
LLAVA_NEXT_VIDEO_TEMPLATE = LLAVA_TEMPLATE.replace(
    "{{ '<image>\n' }}{% endfor %}",
    "{{ '<image>\n' }}{% endfor %}"
    "{% for item in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\n' }}{% endfor %}",
)

INTERNVL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# the same render, the assistant's text and <|im_end|> marked
MARKED["internvl"] = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{% for content in message['content'] %}{{ content['text'] }}{% endfor %}"
    "{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _tokenizer(specials: list[str], eos: str, pad: str, bos: str):
    from vlft_models import _tiny

    tokenizer = _tiny.build_tokenizer(320, specials, eos=eos, pad=pad)
    tokenizer.bos_token = bos
    return tokenizer


def build_mistral3(path: Path) -> Path:
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessor, PixtralProcessor

    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    specials += ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
    tokenizer = _tokenizer(specials, eos="</s>", pad="<pad>", bos="<s>")
    ids = tokenizer.convert_tokens_to_ids
    config = Mistral3Config(
        text_config=dict(
            TEXT,
            model_type="mistral",
            vocab_size=len(tokenizer),
            bos_token_id=ids("<s>"),
            eos_token_id=ids("</s>"),
            pad_token_id=ids("<pad>"),
            max_position_embeddings=4096,
        ),
        vision_config=dict(
            model_type="pixtral",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=64,
            patch_size=8,
        ),
        image_token_index=ids("[IMG]"),
        spatial_merge_size=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(config)
    _finish(model, tokenizer)
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(size={"longest_edge": 64}, patch_size={"height": 16, "width": 16}),
        tokenizer=tokenizer,
        patch_size=8,
        spatial_merge_size=2,
        chat_template=MISTRAL3_TEMPLATE,
    )
    return _save(path, model, processor)


def build_llava(path: Path) -> Path:
    import torch
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = _tokenizer(["<unk>", "<s>", "</s>", "<pad>", "<image>"], eos="</s>", pad="<pad>", bos="<s>")
    ids = tokenizer.convert_tokens_to_ids
    config = LlavaConfig(
        text_config=dict(
            TEXT,
            model_type="llama",
            vocab_size=len(tokenizer),
            bos_token_id=ids("<s>"),
            eos_token_id=ids("</s>"),
            pad_token_id=ids("<pad>"),
            max_position_embeddings=4096,
        ),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
            projection_dim=32,
        ),
        image_token_index=ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    _finish(model, tokenizer)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_TEMPLATE,
        image_token="<image>",
    )
    return _save(path, model, processor)


def build_llava_next_video(path: Path) -> Path:
    """LLaVA-NeXT-Video as llava-hf has it: CLIP + Llama, any-resolution image tiles with row breaks, and clips
    through ``get_video_features`` (``pixel_values_videos``, each frame's patches pooled 2 x 2)."""
    import torch
    from transformers import (
        LlavaNextImageProcessor,
        LlavaNextVideoConfig,
        LlavaNextVideoForConditionalGeneration,
        LlavaNextVideoProcessor,
        LlavaNextVideoVideoProcessor,
    )

    tokenizer = _tokenizer(["<unk>", "<s>", "</s>", "<pad>", "<image>", "<video>"], eos="</s>", pad="<pad>", bos="<s>")
    ids = tokenizer.convert_tokens_to_ids
    pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
    config = LlavaNextVideoConfig(
        text_config=dict(
            TEXT,
            model_type="llama",
            vocab_size=len(tokenizer),
            bos_token_id=ids("<s>"),
            eos_token_id=ids("</s>"),
            pad_token_id=ids("<pad>"),
            max_position_embeddings=4096,
        ),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
            projection_dim=32,
        ),
        image_token_index=ids("<image>"),
        video_token_index=ids("<video>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=pinpoints,
        image_seq_length=16,
        video_seq_length=4,
    )
    torch.manual_seed(0)
    model = LlavaNextVideoForConditionalGeneration(config)
    _finish(model, tokenizer)
    square = {"shortest_edge": 32}, {"height": 32, "width": 32}
    processor = LlavaNextVideoProcessor(
        video_processor=LlavaNextVideoVideoProcessor(size=square[0], crop_size=square[1]),
        image_processor=LlavaNextImageProcessor(size=square[0], crop_size=square[1], image_grid_pinpoints=pinpoints),
        tokenizer=tokenizer,
        chat_template=LLAVA_NEXT_VIDEO_TEMPLATE,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    return _save(path, model, processor)


def build_internvl(path: Path) -> Path:
    """InternVL 3 as the -hf checkpoints have it (InternViT, pixel-shuffle projector, Qwen2 text; the processor writes
    <img><IMG_CONTEXT>*N</img> per tile), its tokenizer naming the image tokens as the processor reads them."""
    import torch
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVideoProcessor,
        PreTrainedTokenizerFast,
    )

    names = dict(start_image_token="<img>", end_image_token="</img>", context_image_token="<IMG_CONTEXT>")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *names.values(), "<video>"]
    base = _tokenizer(specials, eos="<|im_end|>", pad="<|endoftext|>", bos="<|endoftext|>")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        video_token="<video>",
        **names,
    )
    ids = tokenizer.convert_tokens_to_ids
    config = InternVLConfig(
        text_config=dict(
            TEXT,
            model_type="qwen2",
            vocab_size=len(tokenizer),
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
            max_position_embeddings=4096,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=[32, 32],
            patch_size=[8, 8],
        ),
        image_token_id=ids("<IMG_CONTEXT>"),
        image_seq_length=4,  # (32 / 8)^2 patches, pixel-shuffled by 0.5 a side
        downsample_ratio=0.5,
    )
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(config)
    _finish(model, tokenizer)
    size = {"height": 32, "width": 32}
    processor = InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=True, max_patches=2),
        tokenizer=tokenizer,
        video_processor=InternVLVideoProcessor(size=size),
        image_seq_length=4,
        chat_template=INTERNVL_TEMPLATE,
    )
    return _save(path, model, processor)


def _finish(model, tokenizer) -> None:
    ids = tokenizer.convert_tokens_to_ids
    model.generation_config.eos_token_id = ids(tokenizer.eos_token)
    model.generation_config.pad_token_id = ids(tokenizer.pad_token)
    model.generation_config.do_sample = False


def _save(path: Path, model, processor) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def build_llava_plain(path: Path) -> Path:
    """LLaVA with its template's {% generation %} markers taken out: labels from each turn's rendered prefix, which
    here trains the space the template writes after 'ASSISTANT:' (its prompt ends at the colon), where the markers
    leave it out."""
    build_llava(path)
    plain = LLAVA_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    (path / "chat_template.jinja").write_text(plain)  # where transformers 5's save_pretrained writes it
    return path


BUILDERS = {
    "mistral3": build_mistral3,
    "llava": build_llava,
    "llava-plain": build_llava_plain,
    "internvl": build_internvl,
    "llava_next_video": build_llava_next_video,
}


def build(kind: str, path: Path) -> Path:
    return BUILDERS[kind](Path(path))
