"use strict";(self.rspackChunkjupyter_gpushare=self.rspackChunkjupyter_gpushare||[]).push([[700],{646(e,r,t){var a=t(601),o=t.n(a),n=t(933),p=(t.n(n))()(o());p.push([e.id,`/* jupyter-gpushare: the GPU share picker and status-bar item */

.jp-gpushare-picker {
  min-width: 460px;
  max-width: 640px;
  font-size: var(--jp-ui-font-size1);
}

.jp-gpushare-simulated {
  color: var(--jp-warn-color0);
}

.jp-gpushare-problem {
  border-left: 3px solid var(--jp-error-color1);
  background: var(--jp-error-color3);
  padding: 4px 8px;
  margin: 8px 0;
}

.jp-gpushare-suggestions {
  margin: 4px 0 0;
  padding-left: 20px;
}

.jp-gpushare-types {
  border-collapse: collapse;
  width: 100%;
  margin: 8px 0;
}

.jp-gpushare-types th,
.jp-gpushare-types td {
  border-bottom: 1px solid var(--jp-border-color2);
  padding: 2px 6px;
  text-align: left;
}

.jp-gpushare-types tbody tr {
  cursor: pointer;
}

.jp-gpushare-types tbody tr:hover {
  background: var(--jp-layout-color2);
}

.jp-gpushare-presets {
  display: flex;
  gap: 6px;
  align-items: center;
  margin: 8px 0;
}

.jp-gpushare-fields {
  display: grid;
  grid-template-columns: 1fr 1fr;
  gap: 6px 12px;
}

.jp-gpushare-fields label {
  display: flex;
  flex-direction: column;
  gap: 2px;
}

.jp-gpushare-fields label.jp-gpushare-invalid input,
.jp-gpushare-fields label.jp-gpushare-invalid select {
  outline: 2px solid var(--jp-error-color1);
}

.jp-gpushare-status {
  padding: 0 6px;
  line-height: 24px;
  white-space: nowrap;
}

.jp-gpushare-preset {
  background: var(--jp-layout-color2);
  color: var(--jp-ui-font-color1);
  border: 1px solid var(--jp-border-color1);
  padding: 2px 10px;
  cursor: pointer;
}

.jp-gpushare-preset:hover {
  background: var(--jp-layout-color3);
}

/* Lab caps dialogs at 500px; the picker needs room for the explanation, table and fields. */
.jp-Dialog-content:has(.jp-gpushare-picker) {
  max-height: 90vh;
}
`,""]),t.d(r,{},{A:p})},933(e){e.exports=function(e){var r=[];return r.toString=function(){return this.map(function(r){var t="",a=void 0!==r[5];return r[4]&&(t+="@supports (".concat(r[4],") {")),r[2]&&(t+="@media ".concat(r[2]," {")),a&&(t+="@layer".concat(r[5].length>0?" ".concat(r[5]):""," {")),t+=e(r),a&&(t+="}"),r[2]&&(t+="}"),r[4]&&(t+="}"),t}).join("")},r.i=function(e,t,a,o,n){"string"==typeof e&&(e=[[null,e,void 0]]);var p={};if(a)for(var s=0;s<this.length;s++){var i=this[s][0];null!=i&&(p[i]=!0)}for(var c=0;c<e.length;c++){var u=[].concat(e[c]);a&&p[u[0]]||(void 0!==n&&(void 0===u[5]||(u[1]="@layer".concat(u[5].length>0?" ".concat(u[5]):""," {").concat(u[1],"}")),u[5]=n),t&&(u[2]&&(u[1]="@media ".concat(u[2]," {").concat(u[1],"}")),u[2]=t),o&&(u[4]?(u[1]="@supports (".concat(u[4],") {").concat(u[1],"}"),u[4]=o):u[4]="".concat(o)),r.push(u))}},r}},601(e){e.exports=function(e){return e[1]}},72(e){var r=[];function t(e){for(var t=-1,a=0;a<r.length;a++)if(r[a].identifier===e){t=a;break}return t}function a(e,a){for(var o={},n=[],p=0;p<e.length;p++){var s=e[p],i=a.base?s[0]+a.base:s[0],c=o[i]||0,u="".concat(i," ").concat(c);o[i]=c+1;var l=t(u),d={css:s[1],media:s[2],sourceMap:s[3],supports:s[4],layer:s[5]};if(-1!==l)r[l].references++,r[l].updater(d);else{var h=function(e,r){var t=r.domAPI(r);return t.update(e),function(r){r?(r.css!==e.css||r.media!==e.media||r.sourceMap!==e.sourceMap||r.supports!==e.supports||r.layer!==e.layer)&&t.update(e=r):t.remove()}}(d,a);a.byIndex=p,r.splice(p,0,{identifier:u,updater:h,references:1})}n.push(u)}return n}e.exports=function(e,o){var n=a(e=e||[],o=o||{});return function(e){e=e||[];for(var p=0;p<n.length;p++){var s=t(n[p]);r[s].references--}for(var i=a(e,o),c=0;c<n.length;c++){var u=t(n[c]);0===r[u].references&&(r[u].updater(),r.splice(u,1))}n=i}}},659(e){var r={};e.exports=function(e,t){var a=function(e){if(void 0===r[e]){var t=document.querySelector(e);if(window.HTMLIFrameElement&&t instanceof window.HTMLIFrameElement)try{t=t.contentDocument.head}catch(e){t=null}r[e]=t}return r[e]}(e);if(!a)throw Error("Couldn't find a style target. This probably means that the value for the 'insert' parameter is invalid.");a.appendChild(t)}},540(e){e.exports=function(e){var r=document.createElement("style");return e.setAttributes(r,e.attributes),e.insert(r,e.options),r}},56(e,r,t){e.exports=function(e){var r=t.nc;r&&e.setAttribute("nonce",r)}},206(e){e.exports=function(e){if("u"<typeof document)return{update:function(){},remove:function(){}};var r=e.insertStyleElement(e);return{update:function(t){var a,o,n;a="",t.supports&&(a+="@supports (".concat(t.supports,") {")),t.media&&(a+="@media ".concat(t.media," {")),(o=void 0!==t.layer)&&(a+="@layer".concat(t.layer.length>0?" ".concat(t.layer):""," {")),a+=t.css,o&&(a+="}"),t.media&&(a+="}"),t.supports&&(a+="}"),(n=t.sourceMap)&&"u">typeof btoa&&(a+="\n/*# sourceMappingURL=data:application/json;base64,".concat(btoa(unescape(encodeURIComponent(JSON.stringify(n))))," */")),e.styleTagTransform(a,r,e.options)},remove:function(){var e;null===(e=r).parentNode||e.parentNode.removeChild(e)}}}},113(e){e.exports=function(e,r){if(r.styleSheet)r.styleSheet.cssText=e;else{for(;r.firstChild;)r.removeChild(r.firstChild);r.appendChild(document.createTextNode(e))}}},959(e,r,t){var a=t(72),o=t.n(a),n=t(206),p=t.n(n),s=t(659),i=t.n(s),c=t(56),u=t.n(c),l=t(540),d=t.n(l),h=t(113),f=t.n(h),g=t(646),v={};v.styleTagTransform=f(),v.setAttributes=u(),v.insert=i().bind(null,"head"),v.domAPI=p(),v.insertStyleElement=d(),o()(g.A,v),g.A&&g.A.locals&&g.A.locals}}]);