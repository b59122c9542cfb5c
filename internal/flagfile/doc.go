// Package flagfile reads a daemon's config file (--config) and applies it
// to the flags of the daemon's flag.FlagSet that the command line did not
// set: a flag given on the command line always wins over the file.
//
// The format is one setting per line, named exactly as the flag:
//
//	# the coordinator of rack 7
//	data-dir  = /var/lib/kvtier/coordinator
//	http      = 127.0.0.1:9090     # comments may follow a value
//	node-name = "coordinator a"    # quote a value to keep spaces or a '#'
//	insecure  = false
//
// Blank lines and lines starting with '#' are ignored. A key is a flag name
// without dashes; a value runs to the end of the line or to a '#' that
// follows whitespace, and is trimmed. A value in double quotes is a Go
// string literal (escapes included). An empty value sets the flag to the
// empty string. Each key may appear once. A key the command line also sets
// is checked as a key but its value is not applied, nor checked.
//
// The package refuses, naming the file and line: a key that is not a flag of
// the command (a typo must not be silently ignored), a key given twice, a
// value the flag rejects, a "config" key (no nesting), and a key the caller
// marks secret (a config file names paths of credentials, never holds them:
// a file read by many tools and copied around is no place for a key). It
// also refuses a file that is not a regular file, that group or others may
// write, or that is owned by another user than root or the caller: the file
// decides which credentials the daemon loads.
//
// It never reads anything but the one file named by --config, never
// consults the environment, and never changes a flag the command line sets.
package flagfile
