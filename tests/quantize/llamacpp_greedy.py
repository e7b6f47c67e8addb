"""llama.cpp's greedy tokens on a GGUF, in-process in llama-cpp-python (the reference).

Run by the parity test with the llama-cpp-python venv's own interpreter (it imports nothing
of ours): `python llamacpp_greedy.py '{"model": ..., "prompts": [[...]], "tokens": N}'`;
prints {"tokens": [[...]], "margins": [[...]]} (each step's top-1 minus top-2 logit).
"""

import json
import sys

import numpy as np
from llama_cpp import Llama


def main() -> None:
    args = json.loads(sys.argv[1])
    llm = Llama(
        model_path=args["model"],
        n_ctx=256,
        n_batch=256,
        n_threads=2,
        logits_all=True,
        verbose=False,
        seed=0,
    )
    tokens, margins = [], []
    for prompt in args["prompts"]:
        llm.reset()
        llm.eval(prompt)
        out, gaps = [], []
        for _ in range(args["tokens"]):
            logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            top = np.argsort(-logits, kind="stable")[:2]
            out.append(int(top[0]))
            gaps.append(float(logits[top[0]] - logits[top[1]]))
            llm.eval([int(top[0])])
        tokens.append(out)
        margins.append(gaps)
    print(json.dumps({"tokens": tokens, "margins": margins}))


if __name__ == "__main__":
    main()
