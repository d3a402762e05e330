"""`python -m jobstore createdb`: create the database named in DATABASE_URL if it is missing."""

import sys

from sqlalchemy.engine import make_url

from jobstore.db import create_database_if_missing, normalize_url
from jobstore.settings import Settings


def main(argv: list[str]) -> int:
    if argv != ["createdb"]:
        print("usage: python -m jobstore createdb", file=sys.stderr)
        return 2
    url = Settings.from_env().database_url
    created = create_database_if_missing(url)
    print(f"database {make_url(normalize_url(url)).database}: {'created' if created else 'exists'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
