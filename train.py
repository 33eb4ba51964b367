"""``python train.py [group=option ...] [key=value ...]``: the training command of a source
checkout, the same as the installed ``kpool-train`` (see :mod:`recipes.cli`)."""

from recipes.cli import main

if __name__ == "__main__":
    main()
