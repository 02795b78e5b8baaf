package main

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"slices"
	"strconv"
	"strings"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/wait"
)

// The server-side lines of uniqueindex and optimistic (internal/wait.Line): session
// locks (pg_advisory_lock; GET_LOCK named sqllock:l:...) that contended acquirers
// queue for in the database. status lists the sessions in a line as waiters of the
// lock whose line it is, and its holder in the lock's note, not as advisory locks.

// lineRec is one session in a line.
type lineRec struct {
	strategy, key string // the row strategy and hex lock key whose line it is
	waiting       bool
	p             Party
}

// lineTargets returns, for the locks of the line strategies in snap (their lines
// matter while they are held), the server's identifier of each line (PostgreSQL: its
// advisory key as text; MySQL: its GET_LOCK name) with the strategy and hex lock key
// it belongs to.
func lineTargets(ctx context.Context, db *sql.DB, d sqllock.Dialect, snap *snapshot) (map[string][2]string, error) {
	out := map[string][2]string{}
	var keys [][]byte
	var spaces []string
	for _, l := range snap.Locks {
		if !slices.Contains(wait.LineSpaces, l.Strategy) {
			continue
		}
		k, err := hex.DecodeString(l.Key)
		if err != nil {
			continue
		}
		keys, spaces = append(keys, k), append(spaces, l.Strategy)
	}
	if len(keys) == 0 {
		return out, nil
	}
	if d == sqllock.MySQL {
		// MyLineName, computed here: one round trip for the database's name.
		db := dbNameOf(ctx, db)
		for i, k := range keys {
			out[myLineName(db, spaces[i], hex.EncodeToString(k))] = [2]string{spaces[i], keyHex(k)}
		}
		return out, nil
	}
	rows, err := db.QueryContext(ctx, "SELECT s, k, ("+wait.PgLineKeyOf("s", "k")+")::text FROM unnest($1::bytea[], $2::text[]) AS t(k, s)",
		keys, spaces)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var sp, id string
		var k []byte
		if err := rows.Scan(&sp, &k, &id); err != nil {
			return nil, err
		}
		out[id] = [2]string{sp, keyHex(k)}
	}
	return out, rows.Err()
}

// attachLines files the sessions in lines under the locks they wait for: waiters as
// the lock's waiters, the line lock's holder in its note (it is the lock's holder, if
// that came through the line, or the next in line).
func attachLines(snap *snapshot, recs []lineRec) {
	idx := map[string]int{}
	for i, l := range snap.Locks {
		idx[l.Strategy+"/"+l.Key] = i
	}
	for _, r := range recs {
		i, ok := idx[r.strategy+"/"+r.key]
		if !ok {
			i = len(snap.Locks)
			idx[r.strategy+"/"+r.key] = i
			snap.Locks = append(snap.Locks, Lock{Strategy: r.strategy, Key: r.key, Waiters: []Party{},
				Note: "free or being taken; waiters in its server-side line"})
		}
		l := &snap.Locks[i]
		if r.waiting {
			l.Waiters = append(l.Waiters, r.p)
			continue
		}
		s := "server-side line held by session " + partySession(r.p)
		if !strings.Contains(l.Note, s) {
			l.Note = strings.TrimPrefix(l.Note+"; "+s, "; ")
		}
	}
}

func partySession(p Party) string {
	if p.Session == nil {
		return "?"
	}
	return strconv.FormatInt(*p.Session, 10)
}

// routeLines takes the sessions of MySQL GET_LOCK names that are lines
// (wait.MyLinePrefix) out of recs and files them under their locks (attachLines),
// and drops those of fairqueue's tickets (wait.MyTicketPrefix).
// targets is lineTargets' answer if the caller has it, or nil.
func routeLines[R any](ctx context.Context, db *sql.DB, snap *snapshot, targets map[string][2]string, recs []R, f func(R) (name string, waiting bool, p Party)) ([]R, error) {
	var lines []lineRec
	kept := recs[:0]
	for _, r := range recs {
		name, waiting, p := f(r)
		if strings.HasPrefix(name, wait.MyTicketPrefix) {
			continue // a fairqueue ticket's: its waiter is listed from the tickets
		}
		if !strings.HasPrefix(name, wait.MyLinePrefix) {
			kept = append(kept, r)
			continue
		}
		if targets == nil {
			var err error
			if targets, err = lineTargets(ctx, db, sqllock.MySQL, snap); err != nil {
				return nil, err
			}
		}
		t, ok := targets[name]
		if !ok {
			t = [2]string{"line", strings.TrimPrefix(name, wait.MyLinePrefix)} // of a name status does not know
		}
		lines = append(lines, lineRec{strategy: t[0], key: t[1], waiting: waiting, p: p})
	}
	attachLines(snap, lines)
	return kept, nil
}

// myLineName is wait.MyLineNameOf computed here: the GET_LOCK name of the line of
// strategy space for the key keyHex (hexadecimal) in database dbName.
func myLineName(dbName, space, keyHex string) string {
	h := sha256.Sum256([]byte(dbName + ":" + space + ":" + strings.ToUpper(keyHex)))
	return wait.MyLinePrefix + hex.EncodeToString(h[:])[:54]
}

// dbNameOf returns the current database's name ("" if none or unknown).
func dbNameOf(ctx context.Context, db *sql.DB) string {
	var n sql.NullString
	db.QueryRowContext(ctx, "SELECT DATABASE()").Scan(&n)
	return n.String
}
