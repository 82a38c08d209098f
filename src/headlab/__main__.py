"""``python -m headlab ...`` (and ``torchrun ... -m headlab ...``): the same CLI as the ``headlab`` command."""

from headlab.cli.main import main

if __name__ == "__main__":
    main()
