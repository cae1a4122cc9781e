// The server's API key, for a server started with one: typed into a page's "API key" field, kept in this
// browser's localStorage (for this server's origin only) and sent by both pages with every call to the API.
"use strict";

const KEY_STORE = "tracelm.apiKey";

function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

// Headers for a call to the API: `extra`, with `Authorization: Bearer KEY` when a key was given.
function keyHeaders(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// Fills the page's key field with the kept key; a changed key is kept and `onChange` called.
function bindKeyField(input, onChange) {
  input.value = apiKey();
  input.addEventListener("change", () => {
    localStorage.setItem(KEY_STORE, input.value.trim());
    onChange();
  });
}

const NEEDS_KEY = "this server needs its API key: type it into the API key field";
