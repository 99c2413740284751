'use strict';
const query = window.location.search;
const el = (tag, attrs = {}, text) => {
  const svg = ['svg', 'line', 'circle', 'text', 'g'].includes(tag);
  const e = svg ? document.createElementNS('http://www.w3.org/2000/svg', tag)
                : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
};
const row = (cells, attrs = {}) => {
  const tr = el('tr', attrs);
  for (const c of cells) { const td = el('td'); if (c instanceof Node) td.append(c); else td.textContent = c; tr.append(td); }
  return tr;
};
const fill = (id, rows) => document.querySelector(`#${id} tbody`).replaceChildren(...rows);
const hms = ts => new Date(ts * 1000).toLocaleTimeString();
const mbit = bps => bps == null ? '' : `${(bps / 1e6).toFixed(1)} Mbit/s`;
const ms = s => s == null ? '' : `${(s * 1e3).toFixed(1)} ms`;
let last = null;

function drawGraph(st, pos) {
  const g = document.getElementById('graph');
  const W = 600, H = 380, at = n => [pos[n][0] * W, pos[n][1] * H];
  const items = [];
  for (const x of st.links) {
    if (!pos[x.a] || !pos[x.b]) continue;
    const [x1, y1] = at(x.a), [x2, y2] = at(x.b);
    items.push(el('line', {x1, y1, x2, y2, class: x.up ? 'link' : 'link cut', 'data-link': `${x.a}-${x.b}`}));
    const label = [mbit(x.bandwidth_bps), ms(x.latency_s), x.up ? '' : 'cut'].filter(Boolean).join(' ');
    if (label) items.push(el('text', {x: (x1 + x2) / 2, y: (y1 + y2) / 2 - 4, class: 'label'}, label));
  }
  for (const n of st.nodes) {
    if (!pos[n.id]) continue;
    const [cx, cy] = at(n.id);
    const grp = el('g', {class: 'node', 'data-node': n.id});
    if (n.id === st.scheduler) grp.append(el('circle', {cx, cy, r: 20, fill: 'none', stroke: '#1d2430', 'stroke-width': 2}));
    grp.append(el('circle', {cx, cy, r: 15, class: n.state}));
    grp.append(el('text', {x: cx - 8, y: cy + 4, fill: '#fff'}, n.id));
    grp.append(el('text', {x: cx - 18, y: cy + 30, class: 'label'}, n.trainer));
    items.push(grp);
  }
  g.replaceChildren(...items);
}

function render(doc) {
  const err = document.getElementById('error');
  if (!doc.ok) { err.textContent = `no answer: ${doc.error}`; return; }
  err.textContent = '';
  const st = doc.status;
  const act = Object.fromEntries(st.activity.map(a => [a.id, a]));
  const live = st.nodes.filter(n => n.state === 'active').length;
  document.getElementById('summary').textContent =
    `epoch ${st.epoch} · scheduler ${st.scheduler || '-'} (term ${st.term}) · ${live} active of ${st.nodes.length}` +
    (st.paused ? ' · PAUSED (no majority)' : '') + ` · asked ${doc.asked} at ${hms(doc.polled_at)}`;
  drawGraph(st, doc.positions);
  const audited = st.audit && st.audit.step ? `${st.audit.step}${st.audit.agreed ? '' : ' DIFFERED'}` : '';
  fill('members', st.nodes.map(n => {
    const a = act[n.id];
    const phase = a && a.phase ? a.phase : '';
    return row([n.id + (n.id === st.scheduler ? ' (scheduler)' : ''), n.state,
                n.trainer + (phase ? ` (${phase})` : ''),
                a ? a.step : '', a && a.steps_per_s ? a.steps_per_s.toFixed(1) : '',
                n.neighbors.join(', '), n.id === st.node_id ? audited : '', 'direct', '-'],
               {'data-node': n.id, 'data-state': n.state, 'data-phase': phase,
                class: `state-${n.state}`});
  }));
  fill('joins', st.joins.map(j => {
    const p = j.pull, frac = p && p.total_bytes ? p.pulled_bytes / p.total_bytes : 0;
    const bar = el('span', {class: 'bar'}); bar.append(el('span', {style: `width:${(100 * frac).toFixed(0)}%`}));
    const text = p ? `${(p.pulled_bytes / 1e6).toFixed(1)} of ${(p.total_bytes / 1e6).toFixed(1)} MB` : 'waiting for its donors';
    return row([j.id + (j.phase ? ` (${j.phase})` : ''), text, bar, j.donors.join(', ')],
               {'data-join': j.id});
  }));
  const timed = doc.timeline.filter(e => e.seconds != null &&
    (e.event === 'scale_out_complete' || e.event === 'primitive_done'));
  fill('delays', timed.slice(-12).reverse().map(e =>
    row([hms(e.ts), e.event === 'scale_out_complete' ? 'scale-out' : (e.text.match(/primitive=(\S+)/) || [, 'primitive'])[1],
         e.peer || e.node, e.seconds.toFixed(2)])));
  const f = document.getElementById('filter').value.toLowerCase();
  const shown = doc.timeline.filter(e => !f || `${e.event} ${e.node} ${e.peer || ''} ${e.text}`.toLowerCase().includes(f));
  fill('timeline', shown.slice(-150).reverse().map(e =>
    row([hms(e.ts), e.node, e.event, e.peer || '', e.text], {'data-event': e.event})));
}

async function poll() {
  try {
    const r = await fetch(`api/cluster${query}`, {cache: 'no-store'});
    if (!r.ok) throw new Error(`${r.status} ${await r.text()}`);
    last = await r.json();
    render(last);
  } catch (e) {
    document.getElementById('error').textContent = `dashboard unreachable: ${e.message}`;
  }
  setTimeout(poll, 1000);
}
document.getElementById('filter').addEventListener('input', () => last && render(last));
poll();
