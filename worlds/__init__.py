"""The worlds a run trains on, apart from the method: the built-in toy world (toyworld.py) and its
tiny backbone (toyagent.py, shipped in toy_backbone/), and a real one over Wikipedia (wikiworld.py).
Each writes a FlashRAG corpus, its BM25 index and question files; evolve.py reads any such folder."""

import os

from checkpoint import barrier
from eval import read_questions
from checkpoint import base_dir
from retriever import load_index
from tokenizer import Tokenizer


def load(model_dir, index_dir, train_file, test_file, test_limit, world_dir, world_seed, top_k, rank):
    """(start model folder, BM25 index, train and test questions, tokenizer) of a run: the files named,
    else the toy world in `world_dir` (written on first use, by rank 0, with its backbone)."""
    start_model = model_dir or os.path.join(world_dir, "backbone")  # a checkpoint or a policy folder (lora.py)
    if not (model_dir and index_dir and train_file and test_file):
        from worlds import toyagent  # here: `python -m worlds.toyworld` runs without it imported first
        if rank == 0:
            toyagent.ensure(world_dir, world_seed, top_k)
        barrier()
    index = load_index(index_dir or os.path.join(world_dir, "index"))
    train = read_questions(train_file or os.path.join(world_dir, "train.jsonl"))
    test = read_questions(test_file or os.path.join(world_dir, "test.jsonl"), test_limit)
    return start_model, index, train, test, Tokenizer(os.path.join(base_dir(start_model), "tokenizer.json"))
