#!/usr/bin/env python3
"""Convert a checkpoint made by `specter-pack synth` to GGUF with llama.cpp's own converter.

    python3 scripts/peer_llamacpp_convert.py LLAMA_CPP_DIR CHECKPOINT_DIR OUT.gguf [--outtype f16]

LLAMA_CPP_DIR is a llama.cpp source tree (its convert_hf_to_gguf.py, conversion/ and gguf-py/).
The weights go through the converter untouched. Two things about the synthesized tokenizer stop
the converter, and this script changes only those, at run time, in the converter's process:

- The converter names the pre-tokenizer by hashing how the tokenizer splits a fixed text, and a
  plain byte-level tokenizer with no merges is not in its table. Ours splits as GPT-2's byte-level
  pre-tokenizer does (tokenizer.json says ByteLevel with its regex), so it is declared "gpt-2".
- llama.cpp's loader refuses a BPE vocabulary without merges. The GGUF gets one merge of two
  space bytes; its result is not in the vocabulary, so llama.cpp still encodes every byte as its
  own token, as our tokenizer does (the benchmark's prompts hold no spaces either way).
"""

import argparse
import os
import sys

# The one merge llama.cpp's loader asks for: two byte-level spaces ("\u0120" is the byte-level
# alphabet's space).
PLACEHOLDER_MERGE = "\u0120 \u0120"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("llama_dir", help="llama.cpp source tree")
    ap.add_argument("checkpoint", help="Hugging Face checkpoint directory (specter-pack synth)")
    ap.add_argument("out", help="GGUF file to write")
    ap.add_argument("--outtype", default="f16", help="converter --outtype (default f16)")
    args = ap.parse_args()

    converter = os.path.join(args.llama_dir, "convert_hf_to_gguf.py")
    if not os.path.isfile(converter):
        print(f"error: {converter} not found: LLAMA_CPP_DIR must be a llama.cpp source tree", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        print(f"error: {args.checkpoint} has no config.json", file=sys.stderr)
        return 2
    tokenizer = os.path.join(args.checkpoint, "tokenizer.json")
    if not os.path.isfile(tokenizer):
        print(f"error: {tokenizer} not found", file=sys.stderr)
        return 2

    sys.path[:0] = [args.llama_dir, os.path.join(args.llama_dir, "gguf-py")]
    import gguf  # noqa: E402  (from the tree above, not an installed copy)
    from conversion import base  # noqa: E402

    add_to_gguf = gguf.SpecialVocab.add_to_gguf

    def add_to_gguf_with_merge(self, writer, *rest, **kw):
        if self.load_merges and not self.merges:
            self.merges = [PLACEHOLDER_MERGE]
        return add_to_gguf(self, writer, *rest, **kw)

    gguf.SpecialVocab.add_to_gguf = add_to_gguf_with_merge
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"

    import convert_hf_to_gguf  # noqa: E402

    sys.argv = [converter, args.checkpoint, "--outtype", args.outtype, "--outfile", args.out]
    convert_hf_to_gguf.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
