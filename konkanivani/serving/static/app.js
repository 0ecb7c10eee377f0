// The page of konkanivani-serve: the microphone through an AudioWorklet (capture-worklet.js, which
// resamples to 16 kHz) to the WebSocket /stream as 16-bit PCM, its partial and final results as they
// come; a dropped or chosen file to POST /transcribe. No library, nothing from another origin. The
// token, if the server has one, came as /?token=...: the server set a cookie that same-origin
// requests (the WebSocket's handshake too) carry, so it is taken out of the address bar.
const $ = (id) => document.getElementById(id);
const base = location.pathname.slice(0, location.pathname.lastIndexOf("/") + 1);
let session = null;

if (new URLSearchParams(location.search).has("token")) history.replaceState(null, "", base);

function setState(state, message, isError = false) {
  document.body.dataset.state = state; // for tests: idle, starting, listening, finishing, done, error
  $("status").textContent = message;
  $("status").classList.toggle("error", isError);
}

function seconds(t) { return `${Number(t).toFixed(2)} s`; }

function line(list, start, end, text) {
  const li = document.createElement("li");
  const time = document.createElement("span");
  time.className = "time";
  time.textContent = `${seconds(start)}–${seconds(end)}`;
  const words = document.createElement("span");
  words.className = "text";
  words.textContent = text;
  li.append(time, words);
  list.append(li);
}

async function describe() {
  try {
    const response = await fetch(base + "health");
    const health = await response.json();
    if (!response.ok) throw new Error(health.error || response.statusText);
    const how = health.streaming ? `streaming in chunks of ${health.chunk_ms} ms, ${health.method}` : health.method;
    $("model").textContent = `${health.model} — ${how}`;
    $("start").disabled = !health.streaming;
    setState("idle", health.streaming ? "" : "this model cannot stream (trained without --causal_conv): drop a recording");
  } catch (e) {
    $("model").textContent = "";
    setState("error", `the server did not answer: ${e.message}`, true);
  }
}

function pcm16(floats) {
  const out = new Int16Array(floats.length);
  for (let i = 0; i < floats.length; i++) {
    const s = Math.max(-1, Math.min(1, floats[i]));
    out[i] = s < 0 ? Math.round(s * 32768) : Math.round(s * 32767);
  }
  return out.buffer;
}

function openSocket() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const ws = new WebSocket(`${scheme}://${location.host}${base}stream?format=pcm16&sample_rate=16000`);
  ws.binaryType = "arraybuffer";
  return new Promise((resolve, reject) => {
    ws.onmessage = (e) => {
      const msg = JSON.parse(e.data);
      if (msg.type === "ready") resolve(ws);
    };
    ws.onclose = (e) => reject(new Error(e.reason || "the server refused the stream (a wrong token, or too many " +
                                         "streams: see /health)"));
  });
}

async function start() {
  $("start").disabled = true;
  setState("starting", "starting…");
  $("finals").replaceChildren();
  $("partial").textContent = "";
  try {
    const context = new AudioContext();
    await context.audioWorklet.addModule(base + "static/capture-worklet.js");
    const ws = await openSocket();
    const media = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false } });
    const source = context.createMediaStreamSource(media);
    const node = new AudioWorkletNode(context, "capture");
    session = { context, ws, media, source, node };
    node.port.onmessage = (e) => {
      if (e.data === "flushed") { ws.send(JSON.stringify({ type: "end" })); return; }
      if (ws.readyState === WebSocket.OPEN) ws.send(pcm16(e.data));
    };
    ws.onmessage = (e) => receive(JSON.parse(e.data));
    ws.onclose = (e) => closed(e);
    source.connect(node);
    node.connect(context.destination); // it writes no output: silence, but the graph pulls it
    $("stop").disabled = false;
    setState("listening", `listening (${context.sampleRate} Hz, sent as 16 kHz)`);
  } catch (e) {
    release();
    $("start").disabled = false;
    setState("error", `could not start: ${e.message}`, true);
  }
}

function receive(msg) {
  if (msg.type === "partial") {
    $("partial").textContent = msg.text;
  } else if (msg.type === "final") {
    $("partial").textContent = "";
    if (msg.text) line($("finals"), msg.start, msg.end, msg.text);
  } else if (msg.type === "done") {
    document.body.dataset.audioSeconds = msg.audio_seconds; // for tests: how much audio the server took
    setState("done", `done: ${seconds(msg.audio_seconds)} of audio, decoded in ${seconds(msg.decode_seconds)}`);
  }
}

function closed(e) {
  release();
  $("start").disabled = false;
  $("stop").disabled = true;
  if (document.body.dataset.state !== "done") {
    setState(e.code === 1000 ? "done" : "error", `stream closed (${e.code})${e.reason ? ": " + e.reason : ""}`,
             e.code !== 1000);
  }
}

function stop() {
  if (!session) return;
  $("stop").disabled = true;
  setState("finishing", "finishing…");
  session.source.disconnect();
  session.media.getTracks().forEach((t) => t.stop());
  session.node.port.postMessage("flush"); // the worklet sends its last samples, then "flushed": then the end
}

function release() {
  if (!session) return;
  const { context, media } = session;
  media.getTracks().forEach((t) => t.stop());
  context.close();
  session = null;
}

async function upload(file) {
  $("upload-segments").replaceChildren();
  $("upload-status").classList.remove("error");
  $("upload-status").textContent = `transcribing ${file.name}…`;
  try {
    const response = await fetch(base + "transcribe", { method: "POST", body: file });
    const result = await response.json();
    if (!response.ok) throw new Error(result.error || response.statusText);
    for (const s of result.segments) if (s.text) line($("upload-segments"), s.start, s.end, s.text);
    $("upload-status").textContent = `${file.name}: ${seconds(result.duration)} of audio, decoded in ` +
      `${seconds(result.decode_seconds)}`;
  } catch (e) {
    $("upload-status").classList.add("error");
    $("upload-status").textContent = `${file.name}: ${e.message}`;
  }
}

$("start").addEventListener("click", start);
$("stop").addEventListener("click", stop);
$("file").addEventListener("change", (e) => { if (e.target.files.length) upload(e.target.files[0]); });
const drop = $("drop");
drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (e) => {
  e.preventDefault();
  drop.classList.remove("over");
  if (e.dataTransfer.files.length) upload(e.dataTransfer.files[0]);
});
describe();
