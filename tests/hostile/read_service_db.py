# Attacks the service's data: reads a SQLite database (standing in for the job service's, world-
# readable on the host) through sqlite3 and as raw bytes. solve() returns 1 if it read the secret.
import sqlite3

TOKEN = "@TOKEN@"
DB = "@HOST_TMP@/service.db"


def solve():
    try:
        con = sqlite3.connect(f"file:{DB}?mode=ro", uri=True)
        if any(TOKEN in str(row) for row in con.execute("SELECT * FROM api_keys")):
            return 1
    except Exception:  # noqa: BLE001
        pass
    try:
        with open(DB, "rb") as f:
            if TOKEN.encode() in f.read():
                return 1
    except OSError:
        pass
    return 0
