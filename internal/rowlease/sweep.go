package rowlease

import (
	"context"
	"database/sql"
	"strings"
)

// StashingSweepMySQL is the MySQL sweep of a lease table whose rows carry the
// fencing token of their name (tokenCol of table): the last one granted, which no
// other table records. A batch deletes at most limit rows free (expired) for more
// than us µs, oldest first, after raising their names' sqllock_fence counters to
// their tokens, so that a name used again continues from there. It returns the rows
// deleted and whether the batch was full.
//
// The candidates are read without locks (a consistent read); then, in one
// transaction, their counters are raised under the rows' locks (a locking read of
// the candidates by primary key, still free) and they are deleted by primary key,
// re-checked, and only if the counter now covers their token (the two statements
// read the clock at their own starts: a row freed in between is kept for the next
// batch rather than deleted without its token). FORCE INDEX (PRIMARY), in the statement forms that accept it, makes the
// primary key the only access path whatever the statistics say (on a small table the
// optimizer otherwise prefers a full scan, which at REPEATABLE READ locks every row
// it reads, live ones included): rows are locked one by one in key order, so
// concurrent reapers cannot deadlock with each other, and no index range of
// expires_at is locked (a locking range scan would lock the first live entry past it
// too, and deadlock with releases, renewals and takeovers). A row taken over since
// the candidates were read is kept.
//
// byMinute says that table indexes the minute of acquired_at (a generated column
// acquired_min, as sqllock_lease since migration mysql/0007) instead of expires_at:
// the candidates are then read through that index, earliest acquired first.
func StashingSweepMySQL(ctx context.Context, db *sql.DB, table, tokenCol string, byMinute bool, us int64, limit int) (deleted int, more bool, err error) {
	keys, err := candidatesMySQL(ctx, db, table, byMinute, us, limit)
	if err != nil || len(keys) == 0 {
		return 0, false, err
	}
	args := make([]any, 0, len(keys)+1)
	args = append(args, us)
	for _, k := range keys {
		args = append(args, k)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, false, err
	}
	defer tx.Rollback()
	stash, del := SweepStatementsMySQL(table, tokenCol, len(keys))
	if _, err := tx.ExecContext(ctx, stash, args...); err != nil {
		return 0, false, err
	}
	res, err := tx.ExecContext(ctx, del, args...)
	if err != nil {
		return 0, false, err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, false, err
	}
	if err := tx.Commit(); err != nil {
		return 0, false, err
	}
	return int(n), len(keys) >= limit, nil
}

// CandidatesSQLMySQL is the read of StashingSweepMySQL's candidates in table (see
// candidatesSQL).
func CandidatesSQLMySQL(table string, byMinute bool) string { return candidatesSQL(table, byMinute) }

// SweepStatementsMySQL returns the statements of StashingSweepMySQL for n keys: the
// counters' increase and the delete, each taking the grace in µs and the n keys.
func SweepStatementsMySQL(table, tokenCol string, n int) (stash, del string) {
	in := strings.TrimSuffix(strings.Repeat("?,", n), ",")
	stash = "INSERT INTO sqllock_fence (lock_key, name, token)\nSELECT o.lock_key, o.name, o." + tokenCol + " FROM " + table +
		" o FORCE INDEX (PRIMARY)\nWHERE o." + tokenCol + " > 0 AND o.expires_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AND o.lock_key IN (" + in +
		") FOR UPDATE\n" +
		// not VALUES(token): deprecated on MySQL (1287)
		"ON DUPLICATE KEY UPDATE token = GREATEST(sqllock_fence.token, o." + tokenCol + ")"
	del = "DELETE o FROM " + table + " o FORCE INDEX (PRIMARY) LEFT JOIN sqllock_fence f ON f.lock_key = o.lock_key\nWHERE o." + tokenCol +
		" <= COALESCE(f.token, 0) AND o.expires_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AND o.lock_key IN (" + in + ")"
	return stash, del
}

// candidatesSQL is the read of StashingSweepMySQL's candidates: grace µs, limit;
// by the minute of acquisition (byMinute), grace µs twice, then limit: the range of
// the index on that minute (table_acquired_min) up to the cutoff's minute, which
// holds every row expired before the cutoff (a lease expires after it was acquired),
// then expires_at itself. A row whose expiry was set before its acquisition (the
// last hold of a reentrant lease given back within a second, or a server clock
// stepped back) is read once its acquisition is past the cutoff too. The range also
// holds the live leases acquired before the cutoff: they are read and left, a cost
// that grows with the leases held longer than the grace. The index is forced: on a
// small table the optimizer prefers a scan and a sort, on a large one the range is
// what keeps a batch short.
func candidatesSQL(table string, byMinute bool) string {
	if byMinute {
		return "SELECT lock_key FROM " + table + " FORCE INDEX (" + table + "_acquired_min)" +
			" WHERE acquired_min <= TIMESTAMPDIFF(MINUTE, '1970-01-01 00:00:00', UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND)" +
			"\n  AND expires_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND\nORDER BY acquired_min LIMIT ?"
	}
	return "SELECT lock_key FROM " + table + " WHERE expires_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND\nORDER BY expires_at LIMIT ?"
}

// candidatesMySQL returns the keys of at most limit rows of table expired more than
// us µs ago, oldest first, read without locks.
func candidatesMySQL(ctx context.Context, db *sql.DB, table string, byMinute bool, us int64, limit int) ([][]byte, error) {
	args := []any{us, limit}
	if byMinute {
		args = []any{us, us, limit}
	}
	rows, err := db.QueryContext(ctx, candidatesSQL(table, byMinute), args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	keys := make([][]byte, 0, min(limit, 1024))
	for rows.Next() {
		var k []byte
		if err := rows.Scan(&k); err != nil {
			return nil, err
		}
		keys = append(keys, k)
	}
	return keys, rows.Err()
}
