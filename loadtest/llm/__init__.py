"""The load tool's LLM mode (`python -m loadtest --llm`): requests of Triton's LLM
interface over ModelStreamInfer, measured per token.

`prompts` builds the prompts, `stream` times one request piece by piece, `runner` drives
the closed and open loops, `stats` turns the outcomes into TTFT / ITL / tokens/s, `cli`
is the command line.
"""
