"""The byte vocabulary of simulated workers (`--sim-model bytes`): its facts, no tokenizer.

Ids 0-255 are the bytes of the UTF-8 text; `SPECIAL_TOKENS` follow. The tokenizer that speaks
it is `kvloop.front.byte_tokenizer.ByteTokenizer` (the API process's, next to the real one);
the simulator's runner needs only these numbers.
"""

from __future__ import annotations

BYTE_VOCAB = "bytes"  # the --sim-model value (and the model path a worker reports) for it
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NUM_BYTES = 256
VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)
# Fake tokens of the simulator: printable ASCII only, so generated text always decodes cleanly.
PRINTABLE_IDS = tuple(range(32, 127))
