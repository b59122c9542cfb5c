package deploy

import (
	"fmt"
	"strings"
)

// metricNames returns the metric names a PromQL expression selects, in
// order of appearance, without repeats. It is a lexer, not a parser: it
// skips strings, label matchers ({...}), ranges and subqueries ([...]),
// numbers and durations, Grafana variables ($x, ${x}), the label lists of
// by/without/on/ignoring/group_left/group_right, keywords and aggregation
// operators, and any identifier followed by '(' (a function). What is left
// is a metric name. An unbalanced bracket or string is an error.
//
// (prometheus/promql/parser would do this exactly, at the price of the
// whole prometheus/prometheus module in go.mod; the dashboard's queries
// use a small subset of PromQL, covered by TestMetricNames.)
func metricNames(expr string) ([]string, error) {
	var out []string
	seen := map[string]bool{}
	i, n := 0, len(expr)
	// skipGroup skips from an opening bracket at expr[i] to its match,
	// skipping strings inside.
	skipGroup := func(open, close byte) error {
		depth := 0
		for ; i < n; i++ {
			switch c := expr[i]; {
			case c == '"' || c == '\'' || c == '`':
				j, err := skipString(expr, i)
				if err != nil {
					return err
				}
				i = j - 1
			case c == open:
				depth++
			case c == close:
				depth--
				if depth == 0 {
					i++
					return nil
				}
			}
		}
		return fmt.Errorf("unbalanced %q in %q", open, expr)
	}
	labelList := false // the next '(' opens a label list (after by, on, ...)
	depth := 0         // open parentheses of calls and grouping
	for i < n {
		c := expr[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			i++
		case c == '"' || c == '\'' || c == '`':
			j, err := skipString(expr, i)
			if err != nil {
				return nil, err
			}
			i = j
		case c == '{':
			if err := skipGroup('{', '}'); err != nil {
				return nil, err
			}
		case c == '[':
			if err := skipGroup('[', ']'); err != nil {
				return nil, err
			}
		case c == '(' && labelList:
			labelList = false
			if err := skipGroup('(', ')'); err != nil {
				return nil, err
			}
		case c == '$':
			i++
			if i < n && expr[i] == '{' {
				if err := skipGroup('{', '}'); err != nil {
					return nil, err
				}
				continue
			}
			for i < n && isIdent(expr[i], false) {
				i++
			}
		case c >= '0' && c <= '9' || c == '.' && i+1 < n && expr[i+1] >= '0' && expr[i+1] <= '9':
			for i < n && (isIdent(expr[i], false) || expr[i] == '.' || expr[i] == '+' && (expr[i-1] == 'e' || expr[i-1] == 'E') ||
				expr[i] == '-' && (expr[i-1] == 'e' || expr[i-1] == 'E')) {
				i++
			}
		case isIdent(c, true):
			j := i
			for j < n && isIdent(expr[j], false) {
				j++
			}
			word := expr[i:j]
			i = j
			k := j
			for k < n && (expr[k] == ' ' || expr[k] == '\t' || expr[k] == '\n') {
				k++
			}
			switch {
			case labelKeywords[strings.ToLower(word)]:
				labelList = k < n && expr[k] == '(' // group_left may stand alone
			case keywords[strings.ToLower(word)]:
			case k < n && expr[k] == '(':
				// a function call
			default:
				if !seen[word] {
					seen[word] = true
					out = append(out, word)
				}
			}
		case c == '(':
			depth++
			i++
		case c == ')':
			if depth--; depth < 0 {
				return nil, fmt.Errorf("unbalanced ')' at %d in %q", i, expr)
			}
			i++
		case c == '}' || c == ']':
			return nil, fmt.Errorf("unbalanced %q at %d in %q", c, i, expr)
		default:
			i++ // operators and commas
		}
	}
	if depth != 0 {
		return nil, fmt.Errorf("%d unclosed '(' in %q", depth, expr)
	}
	return out, nil
}

// skipString returns the index just past the string literal at s[i].
func skipString(s string, i int) (int, error) {
	q := s[i]
	for j := i + 1; j < len(s); j++ {
		switch {
		case s[j] == '\\' && q != '`':
			j++
		case s[j] == q:
			return j + 1, nil
		}
	}
	return 0, fmt.Errorf("unterminated string at %d in %q", i, s)
}

func isIdent(c byte, first bool) bool {
	return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || !first && c >= '0' && c <= '9'
}

// labelKeywords are followed by a parenthesized list of label names.
var labelKeywords = map[string]bool{"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true}

// keywords are PromQL words that are never metric names: aggregation
// operators (which may come before their by clause), binary operators and
// modifiers.
var keywords = map[string]bool{
	"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true, "stdvar": true, "count": true,
	"count_values": true, "bottomk": true, "topk": true, "quantile": true, "limitk": true, "limit_ratio": true,
	"and": true, "or": true, "unless": true, "atan2": true, "bool": true, "offset": true, "start": true, "end": true,
	"inf": true, "nan": true,
}
