"""``python -m jshard.demo``: see :mod:`jshard.demo.train`."""

from jshard.demo.train import main

if __name__ == "__main__":
    main()
