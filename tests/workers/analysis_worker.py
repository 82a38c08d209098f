"""One rank of the data-parallel probe and explain-study test: ``python analysis_worker.py RANK WORLD PORT DIR``.

Every rank builds the same tiny BERT classifier (float64) and reads the treebank and dataset that the
test wrote into DIR; :func:`headlab.interpret.probing.probe` and :func:`headlab.interpret.saliency.corpus_study`
split the sentences across the ranks. Rank 0 saves the probe result to ``DIR/probe.json``; the study
writes ``DIR/study/`` itself (rank 0 only).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

CONLLU = "".join(
    f"# sent_id = s{i}\n" + "".join(f"{j + 1}\t{w}\t_\t{pos}\t_\t_\t{head}\t{rel}\t_\t_\n"
                                    for j, (w, pos, head, rel) in enumerate(words)) + "\n"
    for i, words in enumerate([
        [("the", "DET", 2, "det"), ("cat", "NOUN", 3, "nsubj"), ("sat", "VERB", 0, "root"), (".", "PUNCT", 3, "punct")],
        [("she", "PRON", 2, "nsubj"), ("reads", "VERB", 0, "root"), ("books", "NOUN", 2, "obj")],
        [("a", "DET", 2, "det"), ("dull", "ADJ", 3, "amod"), ("film", "NOUN", 0, "root"), (".", "PUNCT", 3, "punct")],
        [("the", "DET", 2, "det"), ("dog", "NOUN", 3, "nsubj"), ("saw", "VERB", 0, "root"), ("the", "DET", 5, "det"),
         ("cat", "NOUN", 3, "obj")],
        [("films", "NOUN", 2, "nsubj"), ("move", "VERB", 0, "root"), ("me", "PRON", 2, "obj"), (".", "PUNCT", 2, "punct")],
    ]))
TSV = "sentence\tlabel\na gripping film\t1\na dull , tired film\t0\nfunny and moving\t1\nit sat there\t0\nbooks\t1\n"


def setup():
    """The tiny classifier every rank (and the test's single process) builds."""
    import transformers

    from headlab.models.named_models import minilm_dir
    from headlab.models.loader import LoadedModel, adapt

    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, attn_implementation="eager",
                                  num_labels=2)
    model = transformers.BertForSequenceClassification(cfg).double().eval()
    adapter = adapt(model)
    return LoadedModel(model, tok, adapter, "tiny-bert-clf", adapter.family, 64)


def study_options():
    from headlab.interpret.saliency import StudyOptions

    return StudyOptions(methods=("attention", "gradient", "integrated_gradients", "leave_one_out"), ig_steps=4,
                        permutations=6, adversarial_steps=2, bootstrap=50)


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    from headlab.interpret.probing import probe
    from headlab.interpret.saliency import study

    loaded = setup()
    r = probe(loaded, os.path.join(out, "tiny.conllu"), head_map_sentences=3, grad_sentences=4)
    if rank == 0:
        with open(os.path.join(out, "probe.json"), "w") as f:
            json.dump(r.to_json(), f)
    s = study(loaded, os.path.join(out, "data.tsv"), os.path.join(out, "study"), options=study_options(),
              progress=False, figures=False)
    assert (s is None) == (rank != 0), "rank 0 returns the study, the others None"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
