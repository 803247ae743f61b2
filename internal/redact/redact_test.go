package redact_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/redact"
)

// namedCases are the connection strings of issue 28, each with the secret
// that must not be printed and a part that must still be shown (so a
// redaction that blanks everything does not pass).
var namedCases = []struct {
	name, in string
	// password is the whole password as its owner meant it; part is what
	// the old redaction printed of it.
	password, part string
	keep           string
}{
	{"URL, plain password", "postgres://relay:s3cret@db:5432/x", "s3cret", "s3cret", "@db:5432/x"},
	{"URL, # first in the password", "postgres://relay:#s3cret@db/x", "#s3cret", "s3cret", "@db/x"},
	{"URL, digits then ? in the password", "postgres://relay:123?s3cret@db/x", "123?s3cret", "s3cret", "@db/x"},
	{"URL, digits then # in the password", "postgres://relay:123#s3cret@db/x", "123#s3cret", "s3cret", "@db/x"},
	{"URL, @ in the password", "postgres://relay:p@ss@word@db/x", "p@ss@word", "ss@word", "@db/x"},
	{"URL, / in the password", "postgres://relay:ab/cd@db/x", "ab/cd", "ab/cd", "@db/x"},
	{"URL, : in the password", "postgres://relay:ab:cd@db/x", "ab:cd", "ab:cd", "@db/x"},
	{"URL, password query param", "postgres://relay@db/x?password=s3cret&sslmode=require", "s3cret", "s3cret", "sslmode=require"},
	{"URL, sslpassword query param", "postgres://relay@db/x?sslmode=verify-full&sslpassword=s3cret", "s3cret", "s3cret", "sslmode=verify-full"},
	{"URL, password param with # in it", "postgres://db/x?password=ab#s3cret&sslmode=require", "ab#s3cret", "s3cret", "sslmode=require"},
	{"URL, escaped param name", "postgres://db/x?pass%77ord=s3cret", "s3cret", "s3cret", "postgres://db/x"},
	{"multi-host URL", "postgres://relay:s3cret@h1:5432,h2:5433/x?target_session_attrs=read-write", "s3cret", "s3cret", "h2:5433"},
	{"multi-host URL, # in the password", "postgres://relay:#s3cret@h1:5432,h2:5433/x", "#s3cret", "s3cret", "h2:5433"},
	{"key=value", "host=db user=relay password=s3cret dbname=x", "s3cret", "s3cret", "dbname=x"},
	{"key=value, quoted with an escaped quote and a space", `host=db password='a\'b c' dbname=x`, "a'b c", "b c", "dbname=x"},
	{"key=value, spaces around =", `host=db password = 's3 cret' dbname=x`, "s3 cret", "s3 cret", "dbname=x"},
	{"key=value, backslash-escaped space unquoted", `host=db password=s3\ cret dbname=x`, "s3 cret", "cret", "dbname=x"},
	{"key=value, sslpassword", `host=db sslpassword=s3cret sslmode=verify-full`, "s3cret", "s3cret", "sslmode=verify-full"},
	{"key=value, first word", `password=s3cret host=db`, "s3cret", "s3cret", "host=db"},
	{"search URLs, comma in the password", "https://u:pa,ss@h1:9200,https://u:pa,ss@h2:9200", "pa,ss", "pa,ss", "h2:9200"},
	{"search URL, comma in the password", "https://u:pa,ss@h:9200", "pa,ss", "ss", "@h:9200"},
	{"search URL, # in the password", "https://u:12#s3cret@h:9200", "12#s3cret", "s3cret", "@h:9200"},
}

func TestURLNamedCases(t *testing.T) {
	for _, c := range namedCases {
		t.Run(c.name, func(t *testing.T) {
			got := redact.URL(c.in)
			require.NotContains(t, got, c.part, "redact.URL(%q)", c.in)
			require.NotContains(t, got, c.password, "redact.URL(%q)", c.in)
			require.Contains(t, got, c.keep, "redact.URL(%q) hides too much", c.in)
		})
	}
}

// Without user info or a password there is nothing to hide.
func TestURLKeepsWhatIsNotSecret(t *testing.T) {
	for _, s := range []string{
		"postgres://relay@db:5432/x?sslmode=verify-full",
		"postgres://db/x",
		"host=db user=relay dbname=x",
		"http://127.0.0.1:9200,http://127.0.0.1:9201",
	} {
		require.Equal(t, s, redact.URL(s))
	}
	require.Equal(t, "postgres://relay:xxxxx@db/x", redact.URL("postgres://relay:#s3cret@db/x"))
	require.True(t, strings.HasPrefix(redact.URL("host=db password='a\\'b c' dbname=x"), "host=db password="))
}
