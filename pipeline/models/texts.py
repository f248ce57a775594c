"""Text the pipeline ships with: the corpus the embedded tiny tokenizer is trained on, and the passages validation
prompts are built from. Written for this project; plain English about the things the pipeline deals with.
"""

PASSAGES = (
    "An accelerator runs a compiled graph. The graph is traced once, with fixed shapes, and every call afterwards "
    "feeds tensors of exactly those shapes. Prompts of other lengths are padded up to the next bucket.",
    "The key and value cache stays on the device between steps. Each decoding step writes one new position with a "
    "masked update and reads every position written before it, so the host never copies the cache back.",
    "Tensor parallelism splits every projection across two cores. Query, key, value, gate and up projections are "
    "split by output columns; the output and down projections are split by input rows and summed afterwards.",
    "A careful build records the compiler version, the exact compiler flags, the checkpoint revision and a checksum "
    "of every file it writes. Anyone can then trace a published artifact back to the inputs that produced it.",
    "Greedy decoding picks the most likely token at every step. Two builds that agree token for token over many "
    "prompts are very likely to compute the same function, and the first step where they disagree tells where to look.",
    "The river ran high after three days of rain. Fishermen waited on the bank, mending nets and telling old stories "
    "about the winter the water froze solid from one side of the valley to the other.",
    "In the morning the market opened early. Traders set out baskets of apples, pears and late plums, and the smell of "
    "fresh bread drifted from the bakery on the corner while the church bell counted seven.",
    "A lighthouse keeper climbs one hundred and twelve steps each evening to light the lamp. On clear nights its beam "
    "reaches ships far beyond the horizon; in fog the horn sounds twice every minute until dawn.",
    "Compilers turn high level descriptions into instructions a machine can execute. Good compilers also explain "
    "themselves: when a graph does not fit in memory they say which tensor, how large, and what limit it crossed.",
    "Memory on the host matters as much as memory on the device. Compiling both ranks at once can need more than the "
    "machine has, and a swap file turns a crash into a slow but finished build.",
    "Reproducible archives sort their members, fix every timestamp and owner, and compress with settings that never "
    "change. The same inputs then give the same bytes, and the same bytes give the same checksum.",
    "Questions about geography are easy to check. The capital of France is Paris, the longest river in Africa is the "
    "Nile, and Mount Everest stands on the border between Nepal and China.",
)

QUESTIONS = (
    "What is the capital of France?",
    "Explain in a few sentences why a compiled graph needs fixed shapes.",
    "Summarise the text above in one paragraph.",
    "List three things a careful build should record, and say why each matters.",
)


def corpus() -> list[str]:
    """Everything the tiny tokenizer is trained on, in a fixed order."""
    return list(PASSAGES) + list(QUESTIONS)
