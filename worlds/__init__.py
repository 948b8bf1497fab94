"""The worlds a run trains on, apart from the method: the built-in toy world (toyworld.py) and its
tiny backbone (toyagent.py, shipped in toy_backbone/), and a real one over Wikipedia (wikiworld.py).
Each writes a FlashRAG corpus, its BM25 index and question files; evolve.py reads any such folder."""
