"""`imagenetsplit`: the hierarchical-hash paper's ImageNetSplit (Jeong, Kim & Song 2019, section 6.3 and
supplementary D): ImageNet 32x32 restricted to the 119 WordNet super-classes with exactly two of the 1000
classes, one to C_train and the other to C_test. Retrieval is then measured on classes the nets never saw.

The pairs are the paper's Table 5, by class name; the names are mapped to WordNet ids with the lemma
list that ships with timm (`timm/data/_info/imagenet_synset_to_lemma.txt`: each name is the first lemma
of exactly one ImageNet-1k synset). The data are the `imagenet32` pickles under `dataset.root`:

    train   the training images of C_train (a random `dataset.val_fraction` held out as val)
    test    the validation images of C_test (the queries and the hash table)

Both label C_train[i] and C_test[i] as class i (the i-th super-class). The pickles' labels 1..1000 follow
the ILSVRC devkit's `map_clsloc.txt` (Chrabaszcz et al.'s scripts), not the sorted wnids: `dataset.class_map`
names that file (relative to the root; `sorted`: labels in sorted-wnid order, timm's imagenet_synsets.txt).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import torch

from runner.checks import ConfigError
from runner.data import Data, register_dataset
from runner.data.builtin import carve
from runner.data.imagenet32 import pickle_files, read_batches, uint8_split
from runner.schema import DatasetConfig

# Table 5 of the supplementary, row by row: four C_train names, then their C_test siblings in order.
TABLE5 = (
    ("tench,electric ray,cock,jay", "goldfish,stingray,hen,magpie"),
    ("common newt,spotted salamander,tree frog,loggerhead", "eft,axolotl,tailed frog,leatherback turtle"),
    ("common iguana,agama,diamondback,trilobite", "American chameleon,frilled lizard,sidewinder,centipede"),
    ("harvestman,quail,African grey,bee eater", "scorpion,partridge,macaw,hornbill"),
    ("jacamar,echidna,flatworm,crayfish", "toucan,platypus,nematode,hermit crab"),
    ("white stork,little blue heron,red-backed sandpiper,Walker hound",
     "black stork,bittern,redshank,English foxhound"),
    ("Irish wolfhound,whippet,Staffordshire bullterrier,vizsla",
     "borzoi,Italian greyhound,American Staffordshire terrier,German short-haired pointer"),
    ("English springer,schipperke,malinois,Siberian husky",
     "Welsh springer spaniel,kuvasz,groenendael,malamute"),
    ("Cardigan,cougar,meerkat,dung beetle", "Pembroke,lynx,mongoose,rhinoceros beetle"),
    ("ant,grasshopper,cockroach,cicada", "bee,cricket,mantis,leafhopper"),
    ("dragonfly,Angora,hippopotamus,siamang", "damselfly,wood rabbit,llama,gibbon"),
    ("indri,African elephant,lesser panda,sturgeon", "Madagascar cat,Indian elephant,giant panda,gar"),
    ("hamper,bicycle-built-for-two,fireboat,cello", "shopping basket,mountain bike,gondola,violin"),
    ("soup bowl,oxygen mask,china cabinet,Polaroid camera",
     "mixing bowl,snorkel,medicine chest,reflex camera"),
    ("bottlecap,freight car,swab,fur coat", "nipple,passenger car,broom,lab coat"),
    ("shower curtain,computer keyboard,bassoon,cliff dwelling", "theater curtain,joystick,oboe,yurt"),
    ("loudspeaker,wool,harvester,oil filter", "microphone,velvet,thresher,strainer"),
    ("accordion,bookcase,suit,beer glass", "harmonica,wardrobe,diaper,goblet"),
    ("vestment,acoustic guitar,barrow,space heater", "academic gown,electric guitar,shopping cart,stove"),
    ("crash helmet,vase,whiskey jug,cleaver", "football helmet,beaker,water jug,letter opener"),
    ("candle,airship,combination lock,electric locomotive", "spotlight,balloon,padlock,steam locomotive"),
    ("barometer,stethoscope,binoculars,Dutch oven", "scale,syringe,projector,rotisserie"),
    ("frying pan,grand piano,church,swing", "wok,upright,mosque,teddy"),
    ("knee pad,crossword puzzle,kimono,catamaran", "apron,jigsaw puzzle,abaya,trimaran"),
    ("feather boa,cocktail shaker,holster,apiary", "stole,saltshaker,scabbard,boathouse"),
    ("birdhouse,pirate,bobsled,slot", "bell cote,wreck,dogsled,vending machine"),
    ("canoe,crutch,pay-phone,cinema", "yawl,flagpole,dial telephone,home theater"),
    ("parking meter,moving van,barbell,ice lolly", "stopwatch,police van,dumbbell,ice cream"),
    ("broccoli,zucchini,acorn squash,orange", "cauliflower,spaghetti squash,butternut squash,lemon"),
    ("eggnog,alp,lakeside", "cup,volcano,seashore"),
)  # fmt: skip


def _timm_info(name: str) -> list[str]:
    """The lines of data file `name` of timm's `data/_info` (found, not imported: importing timm is slow)."""
    return (Path(find_spec("timm").origin).parent / "data" / "_info" / name).read_text().splitlines()


@cache
def imagenet_wnids() -> tuple[str, ...]:
    """The 1000 ILSVRC-2012 wnids in sorted order (timm's imagenet_synsets.txt)."""
    return tuple(line.strip() for line in _timm_info("imagenet_synsets.txt") if line.strip())


def wnid_of_name() -> dict[str, str]:
    """First lemma -> wnid of the ImageNet-1k synsets whose first lemma names one synset only (two
    names, crane and maillot, name two each and are left out)."""
    in_1k = set(imagenet_wnids())
    by_name: dict[str, list[str]] = {}
    for line in _timm_info("imagenet_synset_to_lemma.txt"):
        wnid, lemmas = line.split("\t")
        if wnid in in_1k:
            by_name.setdefault(lemmas.split(",")[0].strip(), []).append(wnid)
    return {name: wnids[0] for name, wnids in by_name.items() if len(wnids) == 1}


@cache
def imagenetsplit_classes() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(C_train, C_test) wnids, pair i the two ImageNet classes of the paper's i-th super-class."""
    wnid = wnid_of_name()
    train, test = (tuple(wnid[name] for row in TABLE5 for name in row[side].split(",")) for side in (0, 1))
    return train, test


def label_order(root: Path, class_map: str) -> list[str]:
    """The wnid of each 1-based label of the pickles, by `dataset.class_map`."""
    if class_map == "sorted":
        return list(imagenet_wnids())
    path = root / class_map
    if not path.is_file():
        raise ConfigError(
            f"dataset.class_map={class_map}: {path} not found; the ImageNet32 labels follow the ILSVRC "
            "devkit's map_clsloc.txt (lines 'n02119789 1 kit_fox'): put it there, or set "
            "dataset.class_map=sorted for pickles labelled in sorted-wnid order"
        )
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    order = {int(row[1]): row[0] for row in rows if len(row) >= 2 and row[1].isdigit()}
    if sorted(order) != list(range(1, 1001)) or set(order.values()) != set(imagenet_wnids()):
        raise ConfigError(
            f"{path}: expected lines '<wnid> <label 1..1000> <name>' for the 1000 ImageNet classes"
        )
    return [order[label] for label in range(1, 1001)]


@dataclass
class ImageNetSplitConfig(DatasetConfig):
    class_map: str = "map_clsloc.txt"  # the pickles' label order, relative to root; sorted: sorted wnids


def _classes_of(files: list[Path], labels: np.ndarray):
    """uint8 images and class ids of the rows of `files` whose 0-based label has an entry >= 0 in
    `labels` (label -> class id), read one file at a time so the full set is never held."""
    xs, ys = [], []
    for f in files:
        x, y = read_batches([f])
        keep = np.flatnonzero(labels[y] >= 0)
        xs.append(x[torch.from_numpy(keep)])
        ys.append(labels[y[keep]])
    return torch.cat(xs), np.concatenate(ys)


@register_dataset("imagenetsplit", schema=ImageNetSplitConfig)
def imagenetsplit(cfg, rng) -> Data:
    train_files, test_file = pickle_files(cfg)
    root = Path(cfg.root).expanduser()
    index = {wnid: label for label, wnid in enumerate(label_order(root, cfg.class_map))}
    c_train, c_test = imagenetsplit_classes()
    splits = []
    for classes, files in ((c_train, train_files), (c_test, [test_file])):
        labels = np.full(1000, -1)
        labels[[index[w] for w in classes]] = np.arange(len(classes))
        splits.append(uint8_split(*_classes_of(files, labels)))
    train, val = carve(splits[0], cfg.val_fraction, rng)
    meta = {"classes": {"train": list(c_train), "test": list(c_test)}}
    return Data(train, val, splits[1], num_classes=len(c_train), input_shape=(3, 32, 32), meta=meta)
