"""The test suite's shared toolkit: what more than one test module builds, serves or compares against (no test
module imports another). One job per module:

- ``tokenizer_files``: SentencePiece models trained in the test run.
- ``decoders``: tiny random GPT-style decoders and their weights; ``decoding``: reference decoding (uncached
  beams, static-cache greedy, transformers' greedy, captured steps) and the relative error the checks bound.
- ``tiny_llama`` and ``llm_families``: tiny transformers LLMs with their NeMo configs and weights.
- ``vision_towers``: tiny transformers vision towers and projector weights; ``projectors``: the projectors by hand.
- ``vlm``: tiny Neva/VILA/video checkpoints; ``neva_reference``: their independent answer; ``neva_hub``: a tower in
  a local Hugging Face hub cache; ``lita_reference``: the LITA/VITA reference; ``lora``: NeMo LoRA adapters and
  their merged reference; ``salm``: the tiny SALM checkpoint, its clips and its reference.
- ``archives``: hostile pickles and tampered ``.nemo`` members.
- ``media``: pictures, PNG bytes, data URLs and videos made in the test; ``media_host``: a media server on loopback.
- ``servers``: starting, polling, querying and stopping servers, and the short-error check; ``demo``: the demo
  Neva, its questions and its servers; ``openai_front``: the OpenAI front in-process and its client.
- ``kernels``: Triton kernels run again under Triton's interpreter.
- ``stub_model``: a deterministic stand-in for the exported model; ``picture_model_type``: a throwaway model type.
- ``nemo_reference_env`` and ``nemo_asr_reference``: NeMo's own ASR modules run in a separate venv.
"""
