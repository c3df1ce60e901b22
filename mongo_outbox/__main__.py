"""``python -m mongo_outbox``: the ``mongo-outbox`` command line."""

from mongo_outbox.cli import main

if __name__ == "__main__":
    main()
