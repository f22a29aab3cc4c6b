package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strings"
	"unicode"

	"github.com/cairn-sandbox/cairn/client"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// Body limits: JSON requests, and file uploads (the engine's own file size limit).
const (
	maxJSONBody   = 1 << 20
	maxUploadBody = 256 << 20
)

// statusOf is the HTTP status of an errdefs code. The SDKs map the code, not the status,
// back to a class.
func statusOf(code string) int {
	switch code {
	case "not_found":
		return http.StatusNotFound
	case "already_exists", "conflict":
		return http.StatusConflict
	case "invalid_argument":
		return http.StatusBadRequest
	case "failed_precondition":
		return http.StatusPreconditionFailed
	case "unavailable":
		return http.StatusServiceUnavailable
	case "resource_exhausted":
		return http.StatusTooManyRequests
	case "permission_denied":
		return http.StatusForbidden
	case "canceled":
		return 499 // client closed request (nginx's convention)
	case "deadline_exceeded":
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}

// statusError gives an error a status other than its class's (413 for a body over its
// limit, 405 for a wrong method, 401 without a valid token).
type statusError struct {
	status int
	err    error
}

func (e *statusError) Error() string { return e.err.Error() }
func (e *statusError) Unwrap() error { return e.err }

func withStatus(status int, err error) error { return &statusError{status: status, err: err} }

// problemOf builds the problem body of err.
func problemOf(err error) client.Problem {
	code := errdefs.Code(err)
	status := statusOf(code)
	var se *statusError
	if errors.As(err, &se) {
		status = se.status
	}
	title := http.StatusText(status)
	if status == 499 {
		title = "Client Closed Request"
	}
	return client.Problem{Type: "urn:cairn:error:" + code, Title: title, Status: status, Code: code, Detail: err.Error()}
}

// writeProblem writes err as an application/problem+json response.
func writeProblem(w http.ResponseWriter, err error) {
	p := problemOf(err)
	if p.Status == http.StatusUnauthorized {
		w.Header().Set("WWW-Authenticate", `Bearer realm="cairnd"`)
	}
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(p.Status)
	json.NewEncoder(w).Encode(p)
}

// writeJSON writes v with the given status.
func writeJSON(w http.ResponseWriter, status int, v any) error {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}

// decode reads exactly one JSON document of type T from the body (at most 1 MiB,
// unknown fields refused). An empty body is the zero value when optional.
func decode(w http.ResponseWriter, r *http.Request, v any, optional bool) error {
	body := http.MaxBytesReader(w, r.Body, maxJSONBody)
	dec := json.NewDecoder(body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		if errors.Is(err, io.EOF) {
			if optional {
				return nil
			}
			return errdefs.InvalidArgument("request body required: send a JSON object (see /v1/openapi.json)")
		}
		return decodeError(err)
	}
	var extra json.RawMessage
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		if err != nil {
			return decodeError(err)
		}
		return errdefs.InvalidArgument("request body: unexpected data after the JSON object")
	}
	return nil
}

func decodeError(err error) error {
	var syn *json.SyntaxError
	var typ *json.UnmarshalTypeError
	var big *http.MaxBytesError
	switch {
	case errors.As(err, &big):
		return withStatus(http.StatusRequestEntityTooLarge, errdefs.ResourceExhausted("request body is larger than %d bytes", big.Limit))
	case errors.As(err, &syn):
		return errdefs.InvalidArgument("malformed JSON at byte %d: %v", syn.Offset, syn)
	case errors.As(err, &typ):
		// Field is the Go path ("Lifetime.ttl_seconds"): keep the JSON names only.
		var parts []string
		for _, f := range strings.Split(typ.Field, ".") {
			if f != "" && !unicode.IsUpper(rune(f[0])) {
				parts = append(parts, f)
			}
		}
		field := strings.Join(parts, ".")
		if field == "" {
			field = "(the body)"
		}
		return errdefs.InvalidArgument("field %s: want %s, got JSON %s", field, jsonKind(typ.Type), typ.Value)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return errdefs.InvalidArgument("malformed JSON: the body ends before the object does")
	case strings.HasPrefix(err.Error(), "json: unknown field"):
		return errdefs.InvalidArgument("%s (see /v1/openapi.json for the fields)", strings.TrimPrefix(err.Error(), "json: "))
	}
	return errdefs.InvalidArgument("malformed request body: %v", err)
}

// jsonKind names a Go type as a JSON type.
func jsonKind(t reflect.Type) string {
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "a boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Map, reflect.Struct:
		return "an object"
	case reflect.Pointer:
		return jsonKind(t.Elem())
	}
	return fmt.Sprint(t)
}
